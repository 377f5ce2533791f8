"""Kernel policy decisions (docs/contracts.md §7) and the recorded backends of a tiny model."""
import logging
import os

import pytest
import torch

from ds_trhash.model import backend
from ds_trhash.model.backend import BackendError, KernelChoice, resolve
from ds_trhash.model.config import TRHashConfig

CFG = TRHashConfig.from_preset("tiny")
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a usable CUDA device exists, with Liger and the kernel importable."""
    monkeypatch.setattr(backend, "_cuda_usable", lambda device: device.type == "cuda")
    monkeypatch.setattr(backend, "_liger_available", lambda: None)
    monkeypatch.setattr(backend, "_triton_kernels_available", lambda: None)
    return monkeypatch


def no_liger(monkeypatch):
    monkeypatch.setattr(backend, "_liger_available", lambda: "ImportError: No module named 'liger_kernel'")


def test_auto_on_cpu_is_pytorch(caplog, monkeypatch):
    monkeypatch.setattr(backend, "_cuda_usable", lambda device: False)
    with caplog.at_level(logging.INFO, logger="ds_trhash.model.backend"):
        choice = resolve("auto", CPU, CFG)
    assert (choice.experts, choice.loss, choice.norm) == ("pytorch", "chunked", "pytorch")
    assert "not a usable CUDA device" in choice.reason
    assert any("kernel fallback" in r.getMessage() for r in caplog.records)


def test_pytorch_policy_is_always_pytorch(fake_cuda):
    for device in (CPU, CUDA):
        choice = resolve("pytorch", device, CFG)
        assert (choice.experts, choice.loss, choice.norm) == ("pytorch", "chunked", "pytorch")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(backend, "_interpreter_enabled", lambda: False)
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        resolve("triton", CPU, CFG)


def test_triton_on_cpu_with_interpreter(monkeypatch):
    monkeypatch.setattr(backend, "_interpreter_enabled", lambda: True)
    monkeypatch.setattr(backend, "_triton_kernels_available", lambda: None)
    choice = resolve("triton", CPU, CFG)
    assert (choice.experts, choice.loss, choice.norm) == ("triton", "chunked", "pytorch")
    with pytest.raises(BackendError, match="bf16"):
        resolve("triton", CPU, CFG, dtype=torch.bfloat16)


def test_triton_import_failure_raises(fake_cuda):
    fake_cuda.setattr(backend, "_triton_kernels_available", lambda: "ImportError: no triton")
    with pytest.raises(BackendError, match="does not import"):
        resolve("triton", CUDA, CFG)
    assert resolve("auto", CUDA, CFG).experts == "pytorch"


def test_auto_on_cuda_picks_fused(fake_cuda):
    choice = resolve("auto", CUDA, TRHashConfig(), dtype=torch.bfloat16)
    assert (choice.experts, choice.loss, choice.norm, choice.rope) == ("triton", "liger", "liger", "liger")


def test_unsupported_shape_or_dtype(fake_cuda):
    wide = TRHashConfig.from_preset("tiny", expert_width=512)
    assert resolve("auto", CUDA, wide).experts == "pytorch"
    with pytest.raises(BackendError, match="expert_width 512"):
        resolve("triton", CUDA, wide)
    assert resolve("auto", CUDA, CFG, dtype=torch.float64).experts == "pytorch"


def test_require_liger_on_cuda_without_liger_raises(fake_cuda):
    no_liger(fake_cuda)
    with pytest.raises(BackendError, match="Liger is required by this profile; install liger-kernel"):
        resolve("auto", CUDA, CFG, require_liger=True)
    with pytest.raises(BackendError, match="Liger is required"):
        resolve("pytorch", CUDA, CFG, require_liger=True)


def test_missing_liger_without_requirement_falls_back(fake_cuda, caplog):
    no_liger(fake_cuda)
    with caplog.at_level(logging.WARNING, logger="ds_trhash.model.backend"):
        choice = resolve("auto", CUDA, CFG)
    assert (choice.experts, choice.loss, choice.norm) == ("triton", "chunked", "pytorch")
    assert "Liger unavailable" in choice.reason
    assert any("Liger unavailable" in r.getMessage() for r in caplog.records)


def test_require_liger_off_cuda_is_a_logged_fallback(monkeypatch):
    monkeypatch.setattr(backend, "_cuda_usable", lambda device: False)
    choice = resolve("auto", CPU, CFG, require_liger=True)
    assert choice.loss == "chunked" and "CUDA only" in choice.reason


def test_bad_policy_and_choice_values():
    with pytest.raises(BackendError, match="unknown kernel policy"):
        resolve("fast", CPU, CFG)
    with pytest.raises(ValueError):
        KernelChoice(experts="cuda", loss="chunked", norm="pytorch", reason="")


class _Recorder:
    def __init__(self):
        self.calls = []

    def set_backends(self, experts=None, loss=None, norm=None):
        self.calls.append((experts, loss, norm))

    def backends_used(self):
        return {"experts": "pytorch", "loss": "chunked", "norm": "pytorch"}


class _Engine:  # a DeepSpeed engine exposes the model as .module
    def __init__(self, module):
        self.module = module


def test_apply_and_record_through_wrapper():
    model = _Recorder()
    backend.apply(_Engine(model), KernelChoice("triton", "liger", "liger", "test"))
    assert model.calls == [("triton", "liger", "liger")]
    assert backend.recorded_backends(_Engine(model)) == {"experts": "pytorch", "loss": "chunked",
                                                         "norm": "pytorch"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or CUDA")
def test_tiny_model_records_triton_and_matches_pytorch():
    from ds_trhash.model import TRHashForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TRHashConfig.from_preset("tiny", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=16, shared_width=32, expert_width=16)
    torch.manual_seed(0)
    model = TRHashForCausalLM(cfg).to(device)
    ids = torch.randint(0, 64, (2, 9), device=device)
    labels = torch.randint(0, 64, (2, 9), device=device)

    choice = resolve("triton", torch.device(device), cfg)
    backend.apply(model, choice)
    loss_t = model(ids, labels=labels)
    assert backend.recorded_backends(model)["experts"] == "triton"
    grads_t = torch.autograd.grad(loss_t, [model.layers[0].mlp.engine.expert_gate, model.embed_tokens.weight])

    backend.apply(model, resolve("pytorch", torch.device(device), cfg))
    loss_p = model(ids, labels=labels)
    assert backend.recorded_backends(model)["experts"] == "pytorch"
    grads_p = torch.autograd.grad(loss_p, [model.layers[0].mlp.engine.expert_gate, model.embed_tokens.weight])

    torch.testing.assert_close(loss_t, loss_p, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_t, grads_p):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
