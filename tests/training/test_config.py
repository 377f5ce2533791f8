"""Training config: loading, error messages, overrides, DeepSpeed dict, resume-critical keys."""
import dataclasses
import math
import typing
from pathlib import Path

import pytest
import yaml

from ds_trhash.training.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    dump_config,
    load_config,
    require_source_stage,
    to_deepspeed_dict,
    tokens_per_step,
    training_critical,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "ds_configs").glob("*/*.yaml"))

TINY = {"stage": "pretraining", "model": {"preset": "tiny"}, "output_dir": "runs/t", "data": {"seq_len": 128}}
SFT_TINY = {"stage": "supervised-finetuning", "model": {"preset": "tiny"}, "output_dir": "runs/s",
            "data": {"kind": "sft", "seq_len": 128}, "source_stage": "refinement"}


def write(tmp_path, doc, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return p


def error(tmp_path, doc, overrides=()):
    p = write(tmp_path, doc)
    with pytest.raises(ConfigError) as info:
        load_config(p, overrides)
    return str(p), info.value


def test_every_shipped_config_loads():
    assert len(CONFIGS) == 8, [c.name for c in CONFIGS]
    for path in CONFIGS:
        cfg = load_config(path)
        assert cfg.output_dir.startswith("runs/")
        if cfg.stage == "supervised-finetuning":
            # The source stage is a fact of the launch, given on the command line (--source-stage).
            assert cfg.source_stage is None
            with pytest.raises(ConfigError, match="pass --source-stage"):
                require_source_stage(cfg)


def test_200m_sft_is_the_published_recipe():
    cfg = load_config(ROOT / "ds_configs/200m/sft.yaml")
    assert cfg.stage == "supervised-finetuning" and cfg.source_stage is None  # --source-stage at launch
    assert cfg.model.preset == "200m" and cfg.data.kind == "sft" and cfg.data.seq_len == 2048
    o, s = cfg.optimizer, cfg.schedule
    assert (o.lr, o.betas, o.weight_decay, o.grad_clip) == (2e-5, (0.9, 0.95), 0.1, 1.0)
    assert (s.kind, s.warmup_fraction, s.min_warmup_steps, s.floor) == ("cosine", 0.03, 1, 0.1)
    assert cfg.training.epochs == 3 and cfg.training.max_steps is None and cfg.eval.heldout
    assert cfg.precision == "bf16" and cfg.kernels.policy == "auto" and cfg.kernels.require_liger
    assert not cfg.lora.enabled and cfg.eval.heldout


def test_200m_sft_lora_variant():
    cfg = load_config(ROOT / "ds_configs/200m/sft_lora.yaml")
    lo = cfg.lora
    assert lo.enabled and (lo.rank, lo.alpha, lo.dropout, lo.experts) == (16, 16.0, 0.05, False)
    assert lo.targets == ("q_proj", "v_proj", "o_proj", "shared_gate", "shared_up", "shared_down")
    full = load_config(ROOT / "ds_configs/200m/sft.yaml")
    assert dataclasses.replace(cfg, lora=full.lora, output_dir=full.output_dir) == full


def test_200m_pretrain_released_batch():
    cfg = load_config(ROOT / "ds_configs/200m/pretrain.yaml")
    assert tokens_per_step(cfg, 1) == 786_432 and tokens_per_step(cfg, 8) == 786_432
    assert cfg.checkpoint.packs == 40


def test_unknown_key_lists_allowed_keys(tmp_path):
    path, err = error(tmp_path, {**TINY, "optimizer": {"lrr": 1.0}})
    assert str(err).startswith(f"{path}: optimizer.lrr: unknown key")
    assert "betas, eps, grad_clip, lr, torch_adam, weight_decay" in str(err)
    _, err = error(tmp_path, {**TINY, "optimiser": {}})
    assert err.key == "optimiser" and "optimizer" in err.problem


def test_wrong_type_names_expected_type(tmp_path):
    path, err = error(tmp_path, {**TINY, "batch": {"micro_batch": "8"}})
    assert (err.source, err.key) == (path, "batch.micro_batch")
    assert "expected an integer" in err.problem
    _, err = error(tmp_path, {**TINY, "lora": {"enabled": 1}})
    assert "true or false" in err.problem
    _, err = error(tmp_path, {**TINY, "checkpoint": {"keep_unsynced": "yes"}})
    assert err.key == "checkpoint.keep_unsynced" and "true or false" in err.problem
    _, err = error(tmp_path, {**TINY, "data": {"seq_len": 128.0}})
    assert err.key == "data.seq_len"
    _, err = error(tmp_path, {**TINY, "optimizer": {"betas": [0.9]}})
    assert err.key == "optimizer.betas" and "2" in err.problem


def test_missing_required_field(tmp_path):
    doc = dict(TINY)
    del doc["output_dir"]
    path, err = error(tmp_path, doc)
    assert (err.source, err.key) == (path, "output_dir") and "missing required field" in err.problem
    _, err = error(tmp_path, {**TINY, "model": {}})
    assert err.key == "model.preset" and "'200m' | 'tiny'" in err.problem


def test_bad_enum_lists_allowed_values(tmp_path):
    _, err = error(tmp_path, {**TINY, "precision": "fp8"})
    assert err.key == "precision" and "allowed values: fp32, bf16, fp16" in err.problem
    _, err = error(tmp_path, {**TINY, "stage": "pretrain"})
    assert "pretraining, refinement, supervised-finetuning" in err.problem
    _, err = error(tmp_path, {**TINY, "zero": {"stage": True}})  # bool is not the int 1
    assert err.key == "zero.stage"


@pytest.mark.parametrize("doc,key,needle", [
    ({**TINY, "zero": {"stage": 3}}, "zero.stage", "use 0, 1 or 2"),
    ({**TINY, "lora": {"enabled": True}}, "lora.enabled", "supervised-finetuning"),
    ({**TINY, "data": {"kind": "sft"}}, "data.kind", "must be pretrain"),
    ({**SFT_TINY, "data": {"kind": "pretrain"}}, "data.kind", "must be sft"),
    ({**TINY, "data": {"packing": {"policy": "per_document"}}}, "data.packing.policy", "cross_document"),
    ({**TINY, "batch": {"micro_batch": 0}}, "batch.micro_batch", "> 0"),
    ({**TINY, "optimizer": {"lr": 0}}, "optimizer.lr", "> 0"),
    ({**TINY, "optimizer": {"lr": -1.0e-4}}, "optimizer.lr", "> 0"),
    ({**TINY, "optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas", "[0, 1)"),
    ({**TINY, "optimizer": {"betas": [-0.1, 0.9]}}, "optimizer.betas", "[0, 1)"),
    ({**TINY, "schedule": {"warmup_fraction": 1.0}}, "schedule.warmup_fraction", "[0, 1)"),
    ({**TINY, "schedule": {"floor": 1.5}}, "schedule.floor", "[0, 1]"),
    ({**TINY, "parallel": {"ep_size": 3}}, "parallel.ep_size", "allowed: 1, 2, 4"),
    ({**TINY, "training": {"epochs": 2}}, "training.epochs", "repetition is forbidden"),
    ({**TINY, "source_stage": "refinement"}, "source_stage", "null"),
    ({**TINY, "kernels": {"policy": "pytorch", "require_liger": True}}, "kernels.require_liger", "policy auto"),
    ({**TINY, "kernels": {"policy": "pytorch", "experts": "triton"}}, "kernels.experts", "never runs the Triton"),
    ({**TINY, "kernels": {"experts": "fast"}}, "kernels.experts", "masked"),
    ({**TINY, "model": {"preset": "200m"}, "data": {"seq_len": 2048}}, "data.plan", "preset tiny"),
    ({**TINY, "lora": {"targets": ["q_proj", "mlp"]}}, "lora.targets", "shared_gate"),
    ({**TINY, "lora": {"targets": []}}, "lora.targets", "at least one"),
    ({**TINY, "lora": {"dropout": 1.0}}, "lora.dropout", "[0, 1)"),
    ({**SFT_TINY, "data": {"kind": "sft", "target_tokens": 10}}, "data.target_tokens", "epochs"),
    ({**TINY, "optimizer": {"lr": ".inf"}}, "optimizer.lr", "number"),
    ({**TINY, "data": {"prefetch_minutes": -1}}, "data.prefetch_minutes", ">= 0"),
])
def test_impossible_values_and_combinations(tmp_path, doc, key, needle):
    path, err = error(tmp_path, doc)
    assert err.key == key, str(err)
    assert path in err.source
    assert needle in err.problem, str(err)


def test_seq_len_beyond_model_context(tmp_path):
    _, err = error(tmp_path, {**TINY, "data": {"seq_len": 100_000}})
    assert err.key == "data.seq_len" and "context" in err.problem


def test_overrides_are_typed_and_validated(tmp_path):
    p = write(tmp_path, TINY)
    cfg = load_config(p, ["optimizer.lr=3e-4", "lora.targets=[q_proj, v_proj]", "batch={grad_accum: 4}",
                          "data.target_tokens=1_000"])
    assert cfg.optimizer.lr == pytest.approx(3e-4) and isinstance(cfg.optimizer.lr, float)
    assert cfg.batch.grad_accum == 4 and cfg.batch.micro_batch == 16  # mapping merges into the section
    assert cfg.data.seq_len == 128 and cfg.data.target_tokens == 1000
    with pytest.raises(ConfigError) as info:
        load_config(p, ["optimizer.lrr=1"])
    assert info.value.source == "--set optimizer.lrr" and "allowed keys under optimizer" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(p, ["seed.x=1"])
    assert "not a section" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(p, ["precision=fp8"])
    assert info.value.source == "--set precision" and "bf16" in str(info.value)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(p, ["optimizer.lr"])


def test_combination_error_names_both_sources(tmp_path):
    p = write(tmp_path, TINY)
    with pytest.raises(ConfigError) as info:
        load_config(p, ["stage=supervised-finetuning"])
    assert info.value.key == "data.kind"
    assert str(p) in info.value.source and "--set stage" in info.value.source


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    p = write(tmp_path, "stage: pretraining\nmodel: {preset: tiny}\noutput_dir: r\ndata: {seq_len: 64}\noptimizer: {lr: 3e-4}\n")
    assert load_config(p).optimizer.lr == pytest.approx(3e-4)


def test_unreadable_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    p = write(tmp_path, "stage: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(p)
    assert info.value.source == str(p)
    p = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_source_stage_checked_at_launch_not_load(tmp_path):
    doc = {k: v for k, v in SFT_TINY.items() if k != "source_stage"}
    p = write(tmp_path, doc)
    cfg = load_config(p)  # loads: the CLI may still supply --source-stage
    with pytest.raises(ConfigError) as info:
        require_source_stage(cfg)
    assert info.value.key == "source_stage" and str(p) in info.value.source
    assert "refinement, supervised-finetuning" in info.value.problem
    assert require_source_stage(load_config(p, ["source_stage=supervised-finetuning"])) == "supervised-finetuning"
    with pytest.raises(ConfigError, match="allowed values"):
        load_config(p, ["source_stage=pretraining"])
    assert require_source_stage(config_from_dict(TINY)) is None


def test_dump_round_trips(tmp_path):
    for path in CONFIGS:
        cfg = load_config(path)
        again = load_config(write(tmp_path, dump_config(cfg)))
        assert again == cfg, path
    dumped = dump_config(load_config(CONFIGS[0]))
    assert "origin" not in dumped and isinstance(dumped["optimizer"]["betas"], list)


def test_deepspeed_dict():
    cfg = config_from_dict(TINY, overrides=["batch.micro_batch=4", "batch.grad_accum=3", "precision=bf16",
                                            "zero.stage=2", "optimizer.grad_clip=0.5"])
    ds = to_deepspeed_dict(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"] == {"stage": 2}
    # bf16: no per-tensor overflow check (the non-finite guard covers it); no synchronising timers
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False} and ds["fp16"]["enabled"] is False
    assert ds["steps_per_print"] >= 10**9 and ds["wall_clock_breakdown"] is False
    assert ds["timers"] == {"throughput": {"enabled": False}}
    # the deepspeed: section still decides: a user turns either back on
    back = to_deepspeed_dict(dataclasses.replace(cfg, deepspeed={"bf16": {"check_grad_overflow": True},
                                                                 "timers": {"throughput": {"enabled": True}}}), 2)
    assert back["bf16"] == {"enabled": True, "check_grad_overflow": True} and back["timers"]["throughput"]["enabled"]
    assert "optimizer" not in ds and "scheduler" not in ds
    fp16 = to_deepspeed_dict(dataclasses.replace(cfg, precision="fp16"), 1)
    assert fp16["fp16"]["enabled"] and not fp16["bf16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0
    fp32 = to_deepspeed_dict(dataclasses.replace(cfg, precision="fp32"), 1)
    assert not fp32["fp16"]["enabled"] and not fp32["bf16"]["enabled"]


def test_world_size_must_tile_expert_parallel_groups():
    cfg = config_from_dict(TINY, overrides=["parallel.ep_size=2"])
    assert to_deepspeed_dict(cfg, 4)["train_batch_size"] == 4 * 16
    with pytest.raises(ConfigError, match="parallel.ep_size"):
        to_deepspeed_dict(cfg, 3)
    with pytest.raises(ValueError):
        tokens_per_step(cfg, 0)


def test_training_critical_tracks_trajectory_not_bookkeeping():
    base = config_from_dict(SFT_TINY)
    crit = training_critical(base)
    for key in ("data.seq_len", "batch.micro_batch", "optimizer.lr", "schedule.floor", "precision",
                "kernels.policy", "source_stage", "seed", "stage", "model.preset", "training.epochs",
                "data.packing.policy", "lora.enabled", "optimizer.betas"):
        assert key in crit, key
    assert "lora.rank" not in crit  # unused LoRA defaults do not block a resume
    same = ["output_dir=elsewhere", "training.log_every=7", "checkpoint.keep_last=1", "eval={heldout: false, select: last}",
            "lora.rank=4", "data.cache_gb=3.0"]
    for item in same:
        assert training_critical(config_from_dict(SFT_TINY, overrides=[item])) == crit, item
    changed = ["optimizer.lr=1.0e-3", "training.epochs=3", "schedule.warmup_fraction=0.1", "seed=7",
               "data.packing.policy=per_document", "batch.grad_accum=2", "kernels.policy=pytorch",
               "source_stage=supervised-finetuning", "optimizer.betas=[0.9, 0.99]", "lora.enabled=true"]
    for item in changed:
        assert training_critical(config_from_dict(SFT_TINY, overrides=[item])) != crit, item
    lora = training_critical(config_from_dict(SFT_TINY, overrides=["lora.enabled=true"]))
    assert lora["lora.rank"] == 16 and lora["lora.targets"][0] == "q_proj"
    assert not math.isnan(crit["optimizer.lr"])


def test_config_is_immutable():
    cfg = config_from_dict(TINY)
    assert isinstance(cfg, TrainConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0


def _schema_keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{f.name}"
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _schema_keys(tp, key + ".")
        else:
            yield key


def test_every_key_is_documented():
    doc = (ROOT / "docs" / "configs.md").read_text()
    keys = list(_schema_keys(TrainConfig))
    assert "optimizer.betas" in keys and "data.packing.policy" in keys and len(keys) > 40
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"docs/configs.md lacks {missing}"


def test_selection_by_heldout_loss_needs_heldout_evaluation():
    from ds_trhash.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.select.*eval.heldout true or eval.select last"):
        load_config("ds_configs/tiny/sft.yaml", ["eval.heldout=false"])
    cfg = load_config("ds_configs/tiny/sft.yaml", ["eval.heldout=false", "eval.select=last"])
    assert cfg.eval.select == "last"


def test_each_component_declares_its_own_section():
    """TrainConfig composes the sections its components declare beside their code (the data's in
    data/config.py, LoRA's beside its targets, the schedule's beside its formula, the model's and
    the kernels' in model/); the YAML keys stay the field names, and a loaded config dumps back."""
    import typing

    from ds_trhash.data.config import DataSection
    from ds_trhash.model.backend import POLICIES, KernelsSection
    from ds_trhash.model.config import ModelSection
    from ds_trhash.model.lora import LoraSection
    from ds_trhash.training.config import TrainConfig, config_from_dict, dump_config, load_config
    from ds_trhash.training.schedule import ScheduleSection

    hints = typing.get_type_hints(TrainConfig)
    assert (hints["data"], hints["lora"], hints["schedule"], hints["model"], hints["kernels"]) == (
        DataSection, LoraSection, ScheduleSection, ModelSection, KernelsSection)
    assert typing.get_args(typing.get_type_hints(KernelsSection)["policy"]) == POLICIES
    cfg = load_config("ds_configs/tiny/sft.yaml", ["lora.rank=4", "schedule.kind=wsd"])
    assert cfg.lora.rank == 4 and cfg.schedule.kind == "wsd" and cfg.model.describe() == "preset tiny"
    assert config_from_dict(dump_config(cfg)) == cfg
