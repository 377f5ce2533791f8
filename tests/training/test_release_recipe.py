"""The release's recipe in the 200m configs (docs/contracts.md §6b): the released plans they name,
the step counts and warmups those give, the schedule at its boundaries, the warmup keys' refusals,
the resume-critical keys, and what preflight says while the plan's dataset cannot be read."""
import math
from pathlib import Path

import pytest
import torch

from ds_trhash.data.plans.budget import check_target_tokens, pack_boundaries, plan_steps
from ds_trhash.data.plans.plan import load_plan, validate_refinement
from ds_trhash.training import config as tcfg
from ds_trhash.training.schedule import build_scheduler, describe_schedule, schedule_warmup_steps
from tests.fail_closed import ds_trhash, tree_digest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "ds_configs" / "200m"
RELEASED = ROOT / "tests" / "data" / "plans" / "release_plans"  # the public files, byte for byte
FINGERPRINT = "b8549c92137b7ee14c01229ec2569afc153299dedc69109a8856adf4d4547d98"
WORLDS = (1, 2, 4, 8, 16, 24, 48)


def load(name, overrides=()):
    return tcfg.load_config(CONFIGS / name, overrides)


def lrs(cfg, total_steps, steps):
    """The LR each of ``steps`` trains at, from the scheduler the engine builds: the first steps by
    stepping it, the others from the lambda it evaluates at that step (stepping 165k times is slow)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    sched = build_scheduler(opt, total_steps, cfg.schedule, tcfg.tokens_per_step(cfg, 8))
    stepped = []
    for _ in range(3):
        stepped.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    by_lambda = {step: cfg.optimizer.lr * sched.lr_lambdas[0](step) for step in steps}
    assert stepped == pytest.approx([by_lambda.get(k, cfg.optimizer.lr * sched.lr_lambdas[0](k)) for k in range(3)])
    return by_lambda


def test_pretrain_config_is_the_release_recipe_on_the_released_plan():
    cfg = load("pretrain.yaml")
    assert cfg.data.seq_len == 1024 and cfg.data.shards_dir is None and cfg.checkpoint.packs == 40
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.weight_decay, cfg.optimizer.grad_clip) == \
        (3e-4, (0.9, 0.95), 0.1, 1.0)
    s = cfg.schedule
    assert (s.kind, s.warmup_tokens, s.warmup_start_factor, s.stable_fraction, s.floor, s.warmup_fraction) == \
        ("wsd", 10**9, 0.01, 0.8, 0.1, None)
    plan_file = ROOT / cfg.data.plan
    assert plan_file.read_bytes() == (RELEASED / plan_file.name).read_bytes()
    plan = load_plan(plan_file)
    assert plan.fingerprint == FINGERPRINT and plan.seq_len == cfg.data.seq_len
    assert check_target_tokens(plan, cfg.data.target_tokens, name="data.target_tokens") == plan.trained_tokens
    for world in WORLDS:
        layout = tcfg.batch_layout(cfg, world)
        assert layout.global_tokens == 786_432 and layout.micro_batch * layout.grad_accum * world == 768
        H = plan_steps(plan, tcfg.tokens_per_step(cfg, world))
        assert H == 165_297  # 129,995,112,448 / 786,432 = 165,297.33, rounded down
        assert schedule_warmup_steps(cfg.schedule, H, tcfg.tokens_per_step(cfg, world)) == 1272 == math.ceil(1e9 / 786_432)
    assert len(pack_boundaries(165_297, cfg.checkpoint.packs)) == 40


def test_the_startup_summary_line_states_the_recipe_in_steps():
    pre, ref, sft = load("pretrain.yaml"), load("refine.yaml"), load("sft.yaml")
    assert describe_schedule(pre.schedule, 165_297, 786_432, pre.optimizer.lr) == (
        "wsd: warmup 1,272 steps (1,000,000,000 tokens) from 0.01 x peak, peak 0.0003 for 131,220 more steps, "
        "then a cosine over 32,805 steps to 0.1 x peak at step 165,297")
    assert describe_schedule(ref.schedule, 89_006, 786_432, ref.optimizer.lr) == (
        "cosine: warmup 636 steps (500,000,000 tokens) from 0.01 x peak, peak 0.0001, "
        "then a cosine over 88,370 steps to 0.1 x peak at step 89,006")
    assert describe_schedule(sft.schedule, 5982, 131_072, sft.optimizer.lr) == (
        "cosine: warmup 179 steps (0.03 of the run), peak 2e-05, then a cosine over 5,803 steps to 0.1 x peak "
        "at step 5,982")


def test_pretrain_lr_at_the_schedule_boundaries():
    cfg = load("pretrain.yaml")
    H, W = 165_297, 1272
    R = H - W
    S = int(0.8 * R)
    at = lrs(cfg, H, {0, W - 1, W, W + S - 1, W + S, H - 1})
    peak = 3e-4
    assert at[0] == pytest.approx(peak * (0.01 + 0.99 / W), rel=1e-9)
    assert at[W - 1] == pytest.approx(peak) and at[W] == pytest.approx(peak) and at[W + S - 1] == pytest.approx(peak)
    assert at[W + S] == pytest.approx(peak * (0.1 + 0.45 * (1 + math.cos(math.pi / (R - S)))), rel=1e-9)
    assert at[W + S] < peak
    assert at[H - 1] == pytest.approx(3e-5, rel=1e-9)  # the run ends at 0.1 x peak


def test_refine_config_is_the_release_refinement_of_the_pretraining_plan():
    cfg, pre = load("refine.yaml"), load("pretrain.yaml")
    assert cfg.data.seq_len == 1024 and cfg.data.shards_dir is None and cfg.optimizer.lr == 1e-4
    s = cfg.schedule
    assert (s.kind, s.warmup_tokens, s.warmup_start_factor, s.floor) == ("cosine", 5 * 10**8, 0.01, 0.1)
    plan_file = ROOT / cfg.data.plan
    assert plan_file.read_bytes() == (RELEASED / plan_file.name).read_bytes()
    plan = load_plan(plan_file)
    validate_refinement(plan, load_plan(ROOT / pre.data.plan))
    assert check_target_tokens(plan, cfg.data.target_tokens, name="data.target_tokens") == plan.trained_tokens
    H = plan_steps(plan, tcfg.tokens_per_step(cfg, 8))
    assert H == 89_006  # 69,997,690,880 / 786,432 = 89,006.9
    W = schedule_warmup_steps(cfg.schedule, H, tcfg.tokens_per_step(cfg, 8))
    assert W == 636 == math.ceil(5e8 / 786_432)
    at = lrs(cfg, H, {0, W - 1, W, H - 1})
    assert at[0] == pytest.approx(1e-4 * (0.01 + 0.99 / W)) and at[W - 1] == pytest.approx(1e-4)
    assert at[W] == pytest.approx(1e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi / (H - W)))))
    assert at[H - 1] == pytest.approx(1e-5)


@pytest.mark.parametrize("name", ["sft.yaml", "sft_lora.yaml"])
def test_sft_configs_take_64_packed_rows_a_step(name):
    cfg = load(name)
    assert cfg.data.seq_len == 2048 and cfg.schedule.fraction == 0.03 and cfg.schedule.warmup_tokens is None
    for world in (1, 2, 4, 8):
        layout = tcfg.batch_layout(cfg, world)
        assert layout.global_tokens == 131_072 and layout.micro_batch * layout.grad_accum * world == 64
    # the release's layout: 4 ranks x 16 rows, no accumulation
    assert tcfg.batch_layout(load(name, ["batch.micro_batch=16"]), 4).grad_accum == 1


def test_warmup_in_tokens_and_as_a_fraction_are_refused_together_naming_both_keys(tmp_path):
    with pytest.raises(tcfg.ConfigError) as info:
        load("pretrain.yaml", ["schedule.warmup_fraction=0.03"])
    err = info.value
    assert err.key == "schedule.warmup_tokens" and "schedule.warmup_fraction" in err.problem
    assert "--set schedule.warmup_fraction" in err.source and "pretrain.yaml" in err.source
    assert "keep one of them" in err.problem
    tiny = {"stage": "pretraining", "model": {"preset": "tiny"}, "output_dir": "runs/t", "data": {"seq_len": 128},
            "schedule": {"warmup_tokens": 1000, "warmup_fraction": 0.1}}
    with pytest.raises(tcfg.ConfigError, match="schedule.warmup_tokens: 1000 and schedule.warmup_fraction 0.1"):
        tcfg.config_from_dict(tiny, "t.yaml")
    # nulling the other key is the way out
    assert load("pretrain.yaml", ["schedule.warmup_tokens=null", "schedule.warmup_fraction=0.03"]).schedule.fraction == 0.03


@pytest.mark.parametrize("override,needle", [
    ("schedule.warmup_tokens=0", "> 0"),
    ("schedule.kind=linear", "allowed values: cosine, wsd"),
    ("schedule.stable_fraction=1.0", "[0, 1)"),
    ("schedule.warmup_start_factor=1.0", "[0, 1)"),
    ("schedule.warmup_tokens=1.5e9", "an integer"),
])
def test_bad_schedule_values_are_refused_naming_the_key(override, needle):
    with pytest.raises(tcfg.ConfigError) as info:
        load("pretrain.yaml", [override])
    assert info.value.key == override.split("=")[0] and needle in info.value.problem


def test_the_new_schedule_keys_are_resume_critical_and_absent_at_their_defaults():
    crit = tcfg.training_critical(load("pretrain.yaml"), 8)
    assert (crit["schedule.kind"], crit["schedule.warmup_tokens"], crit["schedule.warmup_start_factor"],
            crit["schedule.stable_fraction"], crit["schedule.warmup_fraction"]) == ("wsd", 10**9, 0.01, 0.8, None)
    for change in ("schedule.warmup_tokens=2000000000", "schedule.warmup_start_factor=0.02",
                   "schedule.stable_fraction=0.9", "schedule.kind=cosine"):
        assert tcfg.training_critical(load("pretrain.yaml", [change]), 8) != crit, change
    # A config that does not use them records exactly the keys it recorded before they existed.
    tiny = tcfg.load_config(ROOT / "ds_configs" / "tiny" / "pretrain.yaml")
    old = tcfg.training_critical(tiny)
    assert not {"schedule.warmup_tokens", "schedule.warmup_start_factor", "schedule.stable_fraction"} & set(old)
    assert old["schedule.warmup_fraction"] == tiny.schedule.warmup_fraction == 0.1 and old["schedule.kind"] == "cosine"
    implicit = tcfg.config_from_dict({"stage": "pretraining", "model": {"preset": "tiny"}, "output_dir": "runs/t",
                                      "data": {"seq_len": 128}})
    assert tcfg.training_critical(implicit)["schedule.warmup_fraction"] == 0.03  # the default, as before


def test_preflight_of_the_200m_pretrain_config_without_network_names_the_dataset_and_the_endpoint(tmp_path):
    before = tree_digest(ROOT / "ds_configs")
    proc = ds_trhash("preflight", "--config", "ds_configs/200m/pretrain.yaml",
                     "--set", f"output_dir={tmp_path / 'run'}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    # (the memory check's verdict depends on this machine's free RAM, so only the data line is judged)
    fail = [line for line in out.splitlines() if line.startswith("FAIL  data: ")]
    assert len(fail) == 1, out[-3000:]
    # with no network (tests/conftest.py points HF_ENDPOINT at a closed loopback port) the data line
    # says plainly that the Hub cannot be reached, naming the plan's dataset and the endpoint tried
    for needle in ("hf://datasets/Pacific-i64/data-32k-200b-tokens", "revision 'main'",
                   "from the Hub at http://127.0.0.1:9", "check the network, HF_ENDPOINT"):
        assert needle in fail[0], fail[0]
    assert "PASS  config:" in out and "786,432 tokens per optimizer step" in out
    assert tree_digest(ROOT / "ds_configs") == before and not (tmp_path / "run").exists()
