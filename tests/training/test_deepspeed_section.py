"""The deepspeed: section: merged into the generated config; owned and unknown keys refused."""
import pytest

from ds_trhash.training import config as tcfg

TINY = "ds_configs/tiny/pretrain.yaml"


def _load(*overrides):
    return tcfg.load_config(TINY, list(overrides))


def _refused(*overrides):
    with pytest.raises(tcfg.ConfigError) as info:
        _load(*overrides)
    return info.value


def test_section_and_set_overrides_are_deep_merged(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(open(TINY).read() + "deepspeed:\n  zero_optimization: {overlap_comm: true}\n"
                    "  csv_monitor: {enabled: true, output_path: mon}\n")
    cfg = tcfg.load_config(path, ["deepspeed.zero_optimization.contiguous_gradients=true",
                                  "deepspeed.tensorboard.enabled=true", "deepspeed.wall_clock_breakdown=true"])
    ds = tcfg.to_deepspeed_dict(cfg, 2)
    # ours stays where the user said nothing; theirs is merged key by key
    assert ds["zero_optimization"] == {"stage": 0, "overlap_comm": True, "contiguous_gradients": True}
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 1
    assert ds["wall_clock_breakdown"] is True
    assert ds["csv_monitor"] == {"enabled": True, "output_path": "mon", "job_name": "pretraining"}
    assert ds["tensorboard"] == {"enabled": True, "output_path": "runs/tiny-pretrain/monitors", "job_name": "pretraining"}


def test_trajectory_settings_are_recorded_for_resume_observers_are_not():
    cfg = _load("deepspeed.zero_optimization.offload_optimizer={device: cpu}", "deepspeed.tensorboard.enabled=true",
                "deepspeed.flops_profiler.enabled=true", "deepspeed.zero_optimization.overlap_comm=true")
    crit = tcfg.training_critical(cfg, 1)
    ds_keys = {k: v for k, v in crit.items() if k.startswith("deepspeed.")}
    assert ds_keys == {"deepspeed.zero_optimization.offload_optimizer.device": "cpu",
                       "deepspeed.zero_optimization.overlap_comm": True}
    assert not any(k.startswith("deepspeed.") for k in tcfg.training_critical(_load(), 1))


@pytest.mark.parametrize("override, owner", [
    ("deepspeed.train_batch_size=64", "batch.global_tokens"),
    ("deepspeed.gradient_accumulation_steps=4", "batch.global_tokens"),
    ("deepspeed.train_micro_batch_size_per_gpu=2", "batch.micro_batch"),
    ("deepspeed.gradient_clipping=0.5", "optimizer.grad_clip"),
    ("deepspeed.bf16.enabled=true", "precision"),
    ("deepspeed.zero_optimization.stage=2", "zero.stage"),
    ("deepspeed.optimizer={type: AdamW, params: {lr: 0.1}}", "optimizer"),
    ("deepspeed.scheduler.type=WarmupLR", "schedule"),
])
def test_owned_keys_are_refused_with_the_yaml_key_to_use(override, owner):
    err = _refused(override)
    assert err.key.startswith(override.split("=")[0]) and f"set {owner}" in err.problem
    assert err.source == f"--set {override.split('=')[0]}"


def test_auto_takes_the_stage_configs_value():
    cfg = _load("deepspeed.train_micro_batch_size_per_gpu=auto", "deepspeed.zero_optimization.stage=auto",
                "deepspeed.gradient_clipping=auto", "deepspeed.bf16={enabled: auto}")
    ds = tcfg.to_deepspeed_dict(cfg, 1)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["zero_optimization"] == {"stage": 0}
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"] == {"enabled": False}
    assert not any(k.startswith("deepspeed.") for k in tcfg.training_critical(cfg, 1))


def test_unknown_keys_are_refused_with_deepspeeds_own_message(tmp_path):
    err = _refused("deepspeed.zero_optimization.overlap_comms=true")  # a pydantic model: DeepSpeed's message
    assert err.key == "deepspeed.zero_optimization.overlap_comms"
    assert "DeepSpeedZeroConfig" in err.problem and "Extra inputs are not permitted" in err.problem
    err = _refused("deepspeed.zero_optimization.offload_optimizer.device=gpu")
    assert "Input should be 'none', 'cpu' or 'nvme'" in err.problem
    err = _refused("deepspeed.tensorbaord.enabled=true")  # top level: DeepSpeed never looks it up
    assert err.key == "deepspeed.tensorbaord.enabled" and "does not know 'tensorbaord'" in err.problem
    err = _refused("deepspeed.flops_profiler={enabled: true, profile_stp: 3}")  # read key by key
    assert err.key == "deepspeed.flops_profiler.profile_stp" and "'flops_profiler.profile_stp'" in err.problem
    # the file is named when the key came from it
    path = tmp_path / "c.yaml"
    path.write_text(open(TINY).read() + "deepspeed: {csv_monitor: {enabeld: true}}\n")
    with pytest.raises(tcfg.ConfigError) as info:
        tcfg.load_config(path)
    assert info.value.source == str(path) and info.value.key == "deepspeed.csv_monitor.enabeld"
    assert "Extra inputs are not permitted" in info.value.problem


def test_removed_eval_every_epoch_says_what_replaced_it(tmp_path):
    err = _refused("training.eval_every_epoch=true")
    assert err.key == "training.eval_every_epoch" and "eval.heldout" in err.problem
    path = tmp_path / "c.yaml"
    path.write_text(open(TINY).read().replace("log_every: 10}", "log_every: 10, eval_every_epoch: false}"))
    with pytest.raises(tcfg.ConfigError, match="training.eval_every_epoch: removed: held-out evaluation"):
        tcfg.load_config(path)
