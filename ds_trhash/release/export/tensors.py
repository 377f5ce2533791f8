"""The tensors an export holds: its float dtypes, the route buffers' fixed integer dtypes, each
layer's fp32 rotary frequencies, the model layout a state dict must match, and the exact
comparison of what was written with what reads back (``writer`` writes the file)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.attention import rope_inv_freq
from ds_trhash.release.export.manifest import ExportError

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Route buffers are data (docs/contracts.md §1): they keep exactly these dtypes, whatever the float dtype.
ROUTE_BUFFER_DTYPES: dict[str, torch.dtype] = {
    "route_table": torch.int64,
    "fused_route_codes": torch.uint8,
    "fused_expert_pairs": torch.int32,
}
# Persisted for transformers (which leaves a buffer absent from the checkpoint uninitialised),
# always fp32: bf16 frequencies would shift RoPE angles by radians at long positions.
ROTARY_SUFFIX = ".self_attn.rotary_emb.inv_freq"


def parse_dtype(dtype: str | torch.dtype) -> tuple[str, torch.dtype]:
    """(name, dtype) of an allowed export float dtype, given either."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in FLOAT_DTYPES.items()}
        if dtype not in names:
            raise ExportError(f"export dtype {dtype} is not allowed; use one of {sorted(FLOAT_DTYPES)}")
        return names[dtype], dtype
    if dtype not in FLOAT_DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not allowed; use one of {sorted(FLOAT_DTYPES)}")
    return dtype, FLOAT_DTYPES[dtype]


def expected_layout(model_config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of a TRHashForCausalLM built from the config, on the meta device."""

    try:
        config = TRHashConfig.from_dict(dict(model_config))
    except (TypeError, ValueError) as exc:
        raise ExportError(f"model_config is not a valid TRHashConfig: {exc}") from exc
    with torch.device("meta"):
        model = TRHashForCausalLM(config)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def prepare_tensors(state_dict: Mapping[str, Any], model_config: Mapping[str, Any],
             float_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Validate the state dict against the model layout and convert it to what will be written."""
    lora_keys = sorted(k for k in state_dict if "lora_" in k)
    if lora_keys:
        raise ExportError(f"the state dict holds LoRA adapter tensors ({lora_keys[0]}, ...); merge them into the "
                          "base weights before exporting (export_checkpoint does this when merge_lora is available)")
    vocab = model_config.get("vocab_size")
    embed = state_dict.get("embed_tokens.weight")
    if embed is None:
        raise ExportError("the state dict has no embed_tokens.weight; it is not a TR-HASH model state dict")
    if not isinstance(vocab, int) or embed.shape[0] != vocab:
        raise ExportError(f"embed_tokens.weight has {embed.shape[0]} rows but the model config says vocab_size "
                          f"{vocab!r}; an export keeps every embedding row (a truncated vocabulary is refused)")
    expected = expected_layout(model_config)
    present = {k for k in state_dict if not k.endswith(ROTARY_SUFFIX)}
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise ExportError(f"the state dict does not match the model config: {'; '.join(parts)}")
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"{key} is a {type(value).__name__}, not a tensor")
        if value.is_meta:
            raise ExportError(f"{key} is a meta tensor (no data); materialise the model before exporting")
        shape, want = expected.get(key, (tuple(value.shape), value.dtype))
        if tuple(value.shape) != shape:
            raise ExportError(f"{key} has shape {list(value.shape)}, the model config expects {list(shape)}")
        tensor = value.detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(float_dtype)
        elif key.rsplit(".", 1)[-1] in ROUTE_BUFFER_DTYPES:
            route_dtype = ROUTE_BUFFER_DTYPES[key.rsplit(".", 1)[-1]]
            if tensor.dtype != route_dtype:
                raise ExportError(f"{key} is {tensor.dtype}; route buffers are stored as {route_dtype} and are "
                                  "never converted (routing is data)")
        elif tensor.dtype != want:
            raise ExportError(f"{key} is {tensor.dtype}, the model expects {want}")
        # A private contiguous copy: safetensors refuses shared storage, and the comparison
        # after reload must not see later in-place edits of the caller's tensors.
        out[key] = tensor.contiguous().clone()
    out.update(rotary_buffers(state_dict, model_config))
    return out


def rotary_buffers(state_dict: Mapping[str, Any], model_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Each layer's fp32 inv_freq, as the trainer computes it; a supplied one must agree."""
    inv_freq = rope_inv_freq(model_config["head_dim"], model_config["rope_theta"])
    out = {}
    for i in range(model_config["num_layers"]):
        key = f"layers.{i}{ROTARY_SUFFIX}"
        given = state_dict.get(key)
        if given is not None and (tuple(given.shape) != tuple(inv_freq.shape)
                                  or not torch.allclose(given.detach().float().cpu(), inv_freq, rtol=1e-3)):
            raise ExportError(f"{key} does not match head_dim {model_config['head_dim']} and rope_theta "
                              f"{model_config['rope_theta']} of the model config")
        out[key] = inv_freq.clone()
    extra = sorted(k for k in state_dict if k.endswith(ROTARY_SUFFIX) and k not in out)
    if extra:
        raise ExportError(f"unexpected {extra[:5]}: the model config has {model_config['num_layers']} layers")
    return out


def compare_tensors(written: Mapping[str, torch.Tensor], reloaded: Mapping[str, torch.Tensor]) -> None:
    """The weights read back from disk are exactly the tensors meant to be written (names, dtypes,
    shapes, bits), else the export is refused."""
    if set(written) != set(reloaded):
        lost = sorted(set(written) - set(reloaded))
        added = sorted(set(reloaded) - set(written))
        raise ExportError(f"reloaded export has different tensor names (lost {lost[:5]}, added {added[:5]})")
    for key, expect in written.items():
        got = reloaded[key]
        if got.dtype != expect.dtype or tuple(got.shape) != tuple(expect.shape):
            raise ExportError(f"reloaded {key} is {got.dtype} {list(got.shape)}, "
                              f"written {expect.dtype} {list(expect.shape)}")
        if not torch.equal(got, expect):
            raise ExportError(f"reloaded {key} differs from the tensor that was written; the export is not exact")
