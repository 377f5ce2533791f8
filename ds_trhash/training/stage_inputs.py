"""The replay-plan inputs of a pretraining or refinement launch, resolved and checked read-only.

Everything here can refuse a launch and nothing here writes: the plan loads and matches the
config's ``seq_len`` and ``TARGET_TOKENS``, the step count fits the plan (never past it), every
source manifest agrees with the plan, and every shard the plan reads is on disk with its
manifest size. The trainer calls this before it builds its shard cache and the model;
``ds-trhash preflight`` calls it to print the same verdicts.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from ds_trhash.data.budget import check_target_tokens, plan_steps
from ds_trhash.data.plan import load_plan
from ds_trhash.data.reader import source_manifests
from ds_trhash.data.shard_check import check_plan_shards
from ds_trhash.model import TRHashConfig
from ds_trhash.training import config as tcfg


@dataclass(frozen=True)
class PretrainInputs:
    plan_path: Path
    shards_dir: Path
    tokenizer_dir: Path | None
    plan: object  # data.plan.ReplayPlan
    manifests: dict  # source -> shard manifest, matched to the plan
    steps: int  # optimizer steps of this launch (the plan's whole steps, or training.max_steps)
    shards: int  # distinct shard files the plan reads
    shard_bytes: int


class ShardFilesError(ValueError):
    """Shards the plan reads are missing or differ from their manifests."""


def target_tokens(cfg: tcfg.TrainConfig) -> str | int | None:
    """TARGET_TOKENS from the environment (when set and not empty), else data.target_tokens."""
    env = os.environ.get("TARGET_TOKENS")
    return env if env not in (None, "") else cfg.data.target_tokens


def pretrain_inputs(cfg: tcfg.TrainConfig, world: int, plan_path, shards_dir, tokenizer_dir=None,
                    deep: bool = False) -> PretrainInputs:
    """Load and check the plan and its shards for ``world`` processes; raises the data layer's
    errors (PlanError, BudgetError, ReaderError, ShardError), ConfigError or ShardFilesError.
    ``deep`` also hashes every shard (as long as reading the corpus once)."""
    plan = load_plan(plan_path)
    if plan.seq_len != cfg.data.seq_len:
        raise tcfg.ConfigError(cfg.origin, "data.seq_len",
                               f"{cfg.data.seq_len} differs from the plan's seq_len {plan.seq_len} ({plan_path})")
    check_target_tokens(plan.doc, target_tokens(cfg))
    steps = plan_steps(plan, tcfg.tokens_per_step(cfg, world), requested_steps=cfg.training.max_steps)
    manifests = source_manifests(shards_dir, plan)
    count, size, problems = check_plan_shards(shards_dir, plan, manifests, deep=deep)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ShardFilesError(f"{len(problems)} of the {count} shards plan {plan_path} reads are unusable: "
                              f"{'; '.join(problems[:3])}{more}; restore them from the shard store or "
                              "re-tokenize that source")
    return PretrainInputs(Path(plan_path), Path(shards_dir), Path(tokenizer_dir) if tokenizer_dir else None,
                          plan, manifests, steps, count, size)


def model_config(cfg: tcfg.TrainConfig):
    """The TRHashConfig a launch of ``cfg`` trains: its preset with the config's loss chunk."""
    return dataclasses.replace(TRHashConfig.from_preset(cfg.model.preset), loss_chunk_tokens=cfg.kernels.loss_chunk_tokens)
