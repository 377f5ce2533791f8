"""batch.micro_batch auto: refused without what it needs, the largest size that fits the memory-cap
double (the estimate as the device's peaks), the CPU budget, and a resume's recorded size."""
import pytest
import torch

from ds_trhash.training import config as tcfg
from ds_trhash.training.memory import auto
from ds_trhash.training.preparation.footprint import GIB, estimate

TINY = "ds_configs/tiny/pretrain.yaml"
CPU = torch.device("cpu")


def _cfg(*overrides):
    return tcfg.load_config(TINY, overrides=["batch.micro_batch=auto", "batch.global_tokens=2048", *overrides])


def _estimate(cfg, m, world=1):
    c = tcfg.for_world(tcfg.with_micro_batch(cfg, m), world)
    return estimate(c, tcfg.model_config(c), world, "cpu").per_rank


@pytest.mark.parametrize(("overrides", "says"), [
    (["batch.global_tokens=null"], "batch.micro_batch: auto chooses among the micro-batches that keep the global "
                                   "batch exact, so it needs batch.global_tokens"),
    (["batch.grad_accum=2"], "batch.micro_batch: auto derives batch.grad_accum from the size it chooses; drop "
                             "batch.grad_accum (2)"),
    (["batch.micro_batch=big"], "batch.micro_batch: expected an integer or 'auto', got str 'big'"),
])
def test_auto_is_refused_without_global_tokens_or_beside_grad_accum(overrides, says):
    with pytest.raises(tcfg.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        _cfg(*overrides)


def test_the_cap_double_picks_the_largest_size_under_the_cap_that_divides_the_batch():
    cfg = _cfg()  # 16 rows of 128 on one rank: candidates 16, 8, 4, 2, 1
    between = (_estimate(cfg, 4) + _estimate(cfg, 8)) // 2
    probe = auto.CappedProbe(int(between / 0.9), lambda m: _estimate(cfg, m))
    choice = auto.choose(cfg, tcfg.model_config(cfg), 1, CPU, 0, probe)
    assert (choice.micro_batch, choice.grad_accum) == (4, 4)
    assert choice.reasons[0] == "batch.micro_batch auto: 4 (grad_accum 4) among 16, 8, 4, 2, 1 (the sizes that " \
                                "divide the 16 rows of a rank's step)"
    assert "measured: 4: " in choice.reasons[2] and ", 8: " in choice.reasons[2]  # 8 probed, over the cap
    tight = auto.CappedProbe(_estimate(cfg, 1) // 2, lambda m: _estimate(cfg, m))
    with pytest.raises(auto.NothingFits, match="not even micro-batch 1 fits"):
        auto.choose(cfg, tcfg.model_config(cfg), 1, CPU, 0, tight)


def test_on_cpu_the_estimate_is_held_against_the_budget_and_the_summary_says_so():
    cfg = _cfg(f"batch.auto_budget_gb={(_estimate(_cfg(), 2) + 1024) / GIB}")
    choice = auto.choose(cfg, tcfg.model_config(cfg), 1, CPU, 0)
    assert choice.micro_batch == 2
    assert "estimate only (CPU: no device memory to measure) against batch.auto_budget_gb" in choice.describe()


def test_a_resume_takes_the_recorded_size_and_a_number_is_left_alone():
    cfg = _cfg()
    resolved, choice = auto.resolve(cfg, tcfg.model_config(cfg), 1, CPU, 0,
                                    {"training_critical": {"batch.micro_batch": 8}})
    assert resolved.batch.micro_batch == 8 and "the size the run recorded" in choice.describe()
    fixed = _cfg("batch.micro_batch=4")
    assert auto.resolve(fixed, tcfg.model_config(fixed), 1, CPU, 0, None) == (fixed, None)


def test_without_a_device_to_probe_preflight_and_smoke_lay_auto_out_by_the_estimate():
    cfg = _cfg(f"batch.auto_budget_gb={(_estimate(_cfg(), 4) + 1024) / GIB}")
    laid, choice = auto.by_estimate(cfg, 1)
    assert laid.batch.micro_batch == choice.micro_batch == 4
    assert tcfg.for_world(laid, 1).batch.grad_accum == 4
    fixed = _cfg("batch.micro_batch=2")
    assert auto.by_estimate(fixed, 1) == (fixed, None)
