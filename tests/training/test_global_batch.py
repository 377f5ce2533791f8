"""batch.global_tokens: grad_accum derived from the world size, refusals that name the way out."""
import pytest

from ds_trhash.data.plans.budget import plan_steps
from ds_trhash.training import config as tcfg
from ds_trhash.checkpoints import ResumeError, check_resume_compatible

ROOT = "ds_configs"
RELEASED_PLAN = {"trained_tokens": 129_995_112_448, "seq_len": 1024}


@pytest.mark.parametrize("stage", ["pretrain", "refine"])
@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 24, 48])
def test_200m_configs_run_unchanged_on_every_listed_world_size(stage, world):
    cfg = tcfg.load_config(f"{ROOT}/200m/{stage}.yaml")
    layout = tcfg.batch_layout(cfg, world)
    assert layout.global_tokens == 786_432 and layout.micro_batch == 16 and layout.grad_accum == 48 // world
    ds = tcfg.to_deepspeed_dict(cfg, world)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (16, 48 // world, 768)
    if stage == "pretrain":
        assert plan_steps(RELEASED_PLAN, tcfg.tokens_per_step(cfg, world)) == 165_297


def test_tiny_configs_split_over_one_and_two_ranks():
    cfg = tcfg.load_config(f"{ROOT}/tiny/pretrain.yaml")
    assert [tcfg.batch_layout(cfg, w).grad_accum for w in (1, 2)] == [2, 1]
    assert tcfg.for_world(cfg, 2).batch.grad_accum == 1 and cfg.batch.grad_accum is None


def _refusal(overrides, world):
    cfg = tcfg.load_config(f"{ROOT}/200m/pretrain.yaml", overrides)
    with pytest.raises(tcfg.ConfigError) as info:
        tcfg.batch_layout(cfg, world)
    return info.value


def test_a_global_batch_that_does_not_divide_names_world_size_and_nearest_choices():
    err = _refusal(["batch.micro_batch=32"], 16)
    assert err.key == "batch.micro_batch" and "world size 16" in err.problem
    assert "micro_batch 16 (grad_accum 3)" in err.problem and "micro_batch 48 (grad_accum 1)" in err.problem
    err = _refusal([], 5)  # 768 rows never split over 5 ranks
    assert err.key == "batch.global_tokens" and "world size 5" in err.problem
    assert "launch on 4 or 6 ranks" in err.problem and "737,280 or 819,200" in err.problem


def test_global_batch_problems_found_at_load_whatever_the_world():
    with pytest.raises(tcfg.ConfigError, match="batch.global_tokens: 786,000 is not a whole number of 1024-token "
                                                "rows.*785,408 or 786,432"):
        tcfg.load_config(f"{ROOT}/200m/pretrain.yaml", ["batch.global_tokens=786000"])
    with pytest.raises(tcfg.ConfigError, match="batch.micro_batch: 7 does not divide the 768 rows.*6, 8"):
        tcfg.load_config(f"{ROOT}/200m/pretrain.yaml", ["batch.micro_batch=7"])
    with pytest.raises(tcfg.ConfigError, match="batch.grad_accum: 5 disagrees"):
        tcfg.load_config(f"{ROOT}/200m/pretrain.yaml", ["batch.grad_accum=5"])


def test_grad_accum_and_global_tokens_that_disagree_on_this_world_size_are_an_error():
    cfg = tcfg.load_config(f"{ROOT}/200m/pretrain.yaml", ["batch.grad_accum=6"])
    assert tcfg.batch_layout(cfg, 8).grad_accum == 6  # they agree on 8 ranks
    err = _refusal(["batch.grad_accum=6"], 4)
    assert err.key == "batch.grad_accum" and "disagrees" in err.problem and "derived: 12 here" in err.problem


def test_without_global_tokens_the_batch_is_per_rank():
    cfg = tcfg.load_config(f"{ROOT}/tiny/pretrain.yaml", ["batch.global_tokens=null", "batch.micro_batch=8"])
    assert [tcfg.tokens_per_step(cfg, w) for w in (1, 2, 3)] == [1024, 2048, 3072]


def test_resume_compares_the_global_batch_so_reshard_two_to_one_needs_no_edit():
    cfg = tcfg.load_config(f"{ROOT}/tiny/pretrain.yaml")
    two, one = tcfg.training_critical(cfg, 2), tcfg.training_critical(cfg, 1)
    assert (two["batch.grad_accum"], one["batch.grad_accum"]) == (1, 2)
    saved = {"stage": "pretraining", "step": 4, "epoch": 0, "data_cursor": 32, "world_size": 2,
             "plan_fingerprint": None, "plan_sha256": None, "backends_used": {}, "lora": False,
             "family": "language", "training_critical": two}
    check_resume_compatible(saved, one, world_size=1, lora_enabled=False, total_steps=10, reshard=True)
    other = tcfg.training_critical(tcfg.load_config(f"{ROOT}/tiny/pretrain.yaml", ["batch.global_tokens=2048"]), 1)
    with pytest.raises(ResumeError, match="global batch: checkpoint 8 rows per step"):
        check_resume_compatible(saved, other, world_size=1, lora_enabled=False, total_steps=10, reshard=True)
