"""The tensors an export holds, checked in memory before any file is written: allowed float
dtypes, the model layout, route buffers never converted, fp32 rotary frequencies, and the exact
comparison after read-back."""

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.attention import rope_inv_freq
from ds_trhash.release.export.manifest import ExportError
from ds_trhash.release.export.tensors import (FLOAT_DTYPES, ROTARY_SUFFIX, compare_tensors, expected_layout, parse_dtype,
                                              prepare_tensors, rotary_buffers)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = TRHashConfig.from_preset("tiny")
    state = {k: v.detach().clone() for k, v in TRHashForCausalLM(cfg).state_dict().items()}
    return cfg.to_dict(), state


def test_dtypes_are_named_either_way_and_others_refused():
    assert parse_dtype("bfloat16") == ("bfloat16", torch.bfloat16)
    assert parse_dtype(torch.float16) == ("float16", torch.float16)
    for bad in ("int8", torch.float64):
        with pytest.raises(ExportError, match="not allowed; use one of"):
            parse_dtype(bad)
    assert set(FLOAT_DTYPES) == {"float32", "bfloat16", "float16"}


def test_floats_convert_route_buffers_keep_their_dtype_and_rotary_is_fp32(tiny):
    config, state = tiny
    out = prepare_tensors(state, config, torch.bfloat16)
    layout = expected_layout(config)
    assert set(out) == set(layout) | {f"layers.{i}{ROTARY_SUFFIX}" for i in range(config["num_layers"])}
    for key, tensor in out.items():
        if key.endswith(ROTARY_SUFFIX):
            assert torch.equal(tensor, rope_inv_freq(config["head_dim"], config["rope_theta"]))
        elif state[key].is_floating_point():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[key].to(torch.bfloat16))
        else:
            assert tensor.dtype == state[key].dtype and torch.equal(tensor, state[key])
    state["embed_tokens.weight"].mul_(0)  # the prepared copy does not follow later edits
    assert out["embed_tokens.weight"].abs().sum() > 0


def test_a_state_dict_off_the_layout_is_refused(tiny):
    config, state = tiny
    route = next(k for k in state if k.endswith("route_table"))
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "norm.weight"}, "missing"),
        "route dtype": ({**state, route: state[route].to(torch.int32)}, "never converted"),
        "shape": ({**state, "norm.weight": state["norm.weight"][:-1]}, "has shape"),
        "lora": ({**state, "layers.0.lora_A": torch.zeros(1)}, "merge them"),
        "rotary": ({**state, f"layers.0{ROTARY_SUFFIX}": torch.ones(2)}, "does not match head_dim"),
    }
    for name, (bad, message) in cases.items():
        with pytest.raises(ExportError, match=message):
            prepare_tensors(bad, config, torch.float32)
    with pytest.raises(ExportError, match="unexpected"):
        rotary_buffers({f"layers.99{ROTARY_SUFFIX}": torch.ones(1)}, config)


def test_the_read_back_must_equal_what_was_written_bit_for_bit():
    written = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([1], dtype=torch.int64)}
    compare_tensors(written, {k: v.clone() for k, v in written.items()})
    for reloaded, message in (({"a": written["a"]}, "different tensor names"),
                              ({**written, "a": written["a"].half()}, "reloaded a is torch.float16"),
                              ({**written, "a": torch.tensor([1.0, 2.0000002])}, "not exact")):
        with pytest.raises(ExportError, match=message):
            compare_tensors(written, reloaded)
