"""The per-shape choice of the routed-experts backend (model/expert_probe.py): the decision from
timings (injected here; measured on the GPU), cached per shape, agreed over ranks, recorded in the
kernel choice and in what the model reports it ran; kernels.experts fixes it without measuring."""
import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM, backend, expert_probe
from ds_trhash.model.backend import BackendError, KernelChoice

TRITON = KernelChoice(experts="triton", loss="chunked", norm="pytorch", reason="policy auto on cuda:0")


def shape(tokens=32768, device="cuda"):
    return expert_probe.Shape(tokens=tokens, hidden=896, width=64, experts=4, dtype=torch.bfloat16,
                              device=torch.device(device))


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(expert_probe, "_CACHE", {})


class Timer:
    """Milliseconds per backend, and which (backend, tokens) were timed."""

    def __init__(self, **ms):
        self.ms, self.calls = ms, []

    def __call__(self, name, at):
        self.calls.append((name, at.tokens))
        return self.ms[name]


def test_the_faster_backend_wins_and_the_kernel_is_kept_within_the_margin():
    assert expert_probe.decide({"triton": 3.2, "masked": 1.1}) == "masked"
    assert expert_probe.decide({"triton": 1.0, "masked": 2.0}) == "triton"
    assert expert_probe.decide({"triton": 1.0, "masked": 0.97}) == "triton"  # 3 %: not worth a switch


def test_measured_once_per_shape_recorded_in_the_choice_and_run_by_the_model():
    timer = Timer(triton=3.19, masked=1.05)
    choice = expert_probe.choose_experts(TRITON, "auto", shape(), timer=timer)
    assert choice.experts == "masked"
    assert choice.experts_probe == {"shape": "32768 tokens, hidden 896, 4 experts of width 64, bfloat16",
                                    "ms": {"triton": 3.19, "masked": 1.05}, "chosen": "masked"}
    assert "experts measured at 32768 tokens" in choice.reason and "-> masked" in choice.reason
    assert choice.to_dict()["experts_probe"]["chosen"] == "masked"  # the start-up summary's kernels line
    again = expert_probe.choose_experts(TRITON, "auto", shape(), timer=timer)
    assert again == choice and timer.calls == [("triton", 32768), ("masked", 32768)]  # cached
    expert_probe.choose_experts(TRITON, "auto", shape(tokens=8192), timer=timer)
    assert timer.calls[2:] == [("triton", 8192), ("masked", 8192)]  # another shape is measured

    cfg = TRHashConfig.from_preset("tiny", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=16, shared_width=32, expert_width=16)
    model = TRHashForCausalLM(cfg)
    backend.apply(model, choice)
    model(torch.randint(0, 64, (2, 9)), labels=torch.randint(0, 64, (2, 9)))
    used = backend.recorded_backends(model)
    assert used["experts"] == "masked" and used["experts_probe"]["ms"] == {"triton": 3.19, "masked": 1.05}


def test_every_rank_picks_from_the_agreed_timings():
    """A rank that alone found the kernel faster still runs what the summed timings say."""
    timer = Timer(triton=1.0, masked=1.5)
    choice = expert_probe.choose_experts(TRITON, "auto", shape(), timer=timer,
                                         agree=lambda ms: {"triton": ms["triton"] + 4.0, "masked": ms["masked"] + 1.0})
    assert choice.experts == "masked" and choice.experts_probe["ms"] == {"triton": 5.0, "masked": 2.5}


def test_nothing_is_measured_off_cuda_or_when_the_policy_did_not_pick_the_kernel():
    timer = Timer(triton=9.0, masked=1.0)
    assert expert_probe.choose_experts(TRITON, "auto", shape(device="cpu"), timer=timer) == TRITON
    gathered = KernelChoice(experts="pytorch", loss="chunked", norm="pytorch", reason="policy pytorch")
    assert expert_probe.choose_experts(gathered, "auto", shape(), timer=timer) == gathered
    assert timer.calls == []


def test_kernels_experts_fixes_the_backend_without_measuring():
    timer = Timer(triton=1.0, masked=9.0)
    masked = expert_probe.choose_experts(TRITON, "masked", shape(), timer=timer)
    assert masked.experts == "masked" and "experts masked (kernels.experts)" in masked.reason and not masked.experts_probe
    assert expert_probe.choose_experts(TRITON, "triton", shape(), timer=timer).experts == "triton"
    assert timer.calls == []
    gathered = KernelChoice(experts="pytorch", loss="chunked", norm="pytorch", reason="policy auto on cpu")
    with pytest.raises(BackendError, match="kernels.experts triton, but the kernel policy could not select"):
        expert_probe.choose_experts(gathered, "triton", shape(device="cpu"))
    with pytest.raises(BackendError, match="kernels.experts 'fast'; allowed"):
        expert_probe.choose_experts(TRITON, "fast", shape())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_measurement_runs_on_the_gpu_and_picks_a_candidate():
    at = expert_probe.Shape(tokens=1024, hidden=128, width=64, experts=4, dtype=torch.float32,
                            device=torch.device("cuda", torch.cuda.current_device()))
    choice = expert_probe.choose_experts(TRITON, "auto", at)
    probe = choice.experts_probe
    assert set(probe["ms"]) == {"triton", "masked"} and all(v > 0 for v in probe["ms"].values())
    assert choice.experts == probe["chosen"] in ("triton", "masked")
