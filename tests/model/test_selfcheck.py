"""Start-up kernel self-check: a selected kernel that computes wrongly is caught before training.

The faulty kernel is injected through the documented hook DS_TRHASH_FAULTY_KERNEL. On CPU the
Triton experts run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""
import os

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM, backend, selfcheck
from ds_trhash.model.backend import BackendError, KernelChoice

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton experts run on CUDA or under TRITON_INTERPRET=1")
# narrow enough for the Triton interpreter to run the check in about a second
CFG = TRHashConfig.from_preset("tiny", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                               shared_width=32, vocab_size=512)


@pytest.fixture(autouse=True)
def small_batch(monkeypatch):
    monkeypatch.setattr(selfcheck, "_TOKENS", 24)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = KernelChoice(experts="triton", loss="chunked", norm="pytorch", reason="test")


def test_a_working_kernel_passes_and_leaves_the_global_rng_alone(monkeypatch):
    monkeypatch.delenv(selfcheck.FAULT_ENV, raising=False)
    rng = torch.get_rng_state()
    checked = selfcheck.verify(TRITON, "auto", DEVICE, CFG)
    assert torch.equal(torch.get_rng_state(), rng)
    assert checked.experts == "triton" and checked.self_check == {"experts": "passed"}


def test_a_faulty_kernel_falls_back_under_auto_and_is_recorded(monkeypatch, caplog):
    monkeypatch.setenv(selfcheck.FAULT_ENV, "experts")
    checked = selfcheck.verify(TRITON, "auto", DEVICE, CFG)
    assert checked.experts == "pytorch" and (checked.loss, checked.norm) == ("chunked", "pytorch")
    assert checked.self_check["experts"].startswith("failed, using pytorch: ")
    assert "differs from the PyTorch reference" in checked.self_check["experts"]
    assert "self-check of the triton experts kernel" in checked.reason
    assert any("kernel fallback" in r.getMessage() for r in caplog.records)
    model = TRHashForCausalLM(CFG)
    backend.apply(model, checked)
    model(torch.randint(0, CFG.vocab_size, (1, 8)))
    used = model.backends_used()
    assert used["experts"] == "pytorch" and used["self_check"] == checked.self_check


def test_a_faulty_kernel_fails_an_explicit_triton_policy(monkeypatch):
    monkeypatch.setenv(selfcheck.FAULT_ENV, "experts")
    with pytest.raises(BackendError, match="self-check of the triton experts kernel .* kernel policy 'triton'"):
        selfcheck.verify(TRITON, "triton", DEVICE, CFG)


def test_a_kernel_that_raises_falls_back(monkeypatch):
    monkeypatch.delenv(selfcheck.FAULT_ENV, raising=False)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    import ds_trhash.kernels.routed_experts as kernels

    monkeypatch.setattr(kernels, "routed_experts_triton", broken)
    checked = selfcheck.verify(TRITON, "auto", DEVICE, CFG)
    assert checked.experts == "pytorch"
    assert "raised RuntimeError: no kernel image for this device" in checked.self_check["experts"]


def test_the_fault_hook_refuses_unknown_names(monkeypatch):
    monkeypatch.setenv(selfcheck.FAULT_ENV, "experts,attention")
    with pytest.raises(BackendError, match=r"unknown kernels \['attention'\]"):
        selfcheck.verify(TRITON, "auto", DEVICE, CFG)


def _rank_worker(rank, port, out):
    import torch.distributed as dist

    if rank == 1:  # the kernel is broken on rank 1's device only
        os.environ[selfcheck.FAULT_ENV] = "experts"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        selfcheck._TOKENS = 24
        checked = selfcheck.verify(TRITON, "auto", "cpu", CFG)
        out[rank] = (checked.experts, checked.self_check["experts"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="two CPU ranks over gloo")
def test_ranks_agree_when_the_kernel_fails_on_one_of_them():
    import torch.multiprocessing as mp

    from tests.training.launch_utils import free_port

    out = mp.Manager().dict()
    mp.start_processes(_rank_worker, args=(free_port(), out), nprocs=2, join=True, start_method="spawn")
    assert out[1][0] == out[0][0] == "pytorch"  # both ranks run the same kernels
    assert "differs from the PyTorch reference" in out[1][1]
    assert out[0][1] == "failed, using pytorch: failed on another rank"
