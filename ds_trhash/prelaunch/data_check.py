"""The data a launch of a config will read, checked the trainer's way and read-only.

Shared by ``preflight`` (which prints the verdict) and ``smoke`` (which needs the full run's
step count and, for pretraining, the plan rows after the ones it trained). It makes the
trainer's own call (``open_stage_data`` of ``plan.data_request``), which writes nothing; the embedded
demo corpus (data paths null) is built in a scratch directory exactly as a launch builds it
beside its output directory (a complete one there is reused, never rewritten).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ds_trhash.data.stage import StageData, embedded_root, open_stage_data
from ds_trhash.training.config import TrainConfig
from ds_trhash.training.preparation.plan import data_request

# A check run before GPUs are rented answers within seconds: it waits out a Hub outage only this
# long (a training launch waits data.hub_wait_minutes).
PREFLIGHT_HUB_WAIT_S = 8.0


def resolve_stage_data(cfg: TrainConfig, world: int, deep: bool, scratch: Path,
                       target_tokens: str | None = None) -> tuple[StageData, str]:
    """(the launch's StageData, what was checked); raises the trainer's user errors when the data
    would refuse the launch. ``deep``: hash every planned shard (else sizes only);
    ``target_tokens``: the launch request's ``TARGET_TOKENS``."""
    embedded = (cfg.data.plan if cfg.data.kind == "pretrain" else cfg.data.sft_dir) is None
    where = f"embedded demo corpus (the launch builds it under {embedded_root(cfg.output_dir)}); " if embedded else ""
    data_cfg = dataclasses.replace(cfg, output_dir=str(Path(scratch) / "run")) if embedded else cfg
    if cfg.data.kind == "sft":
        data = open_stage_data(data_request(data_cfg, 0, world))
        name = "SFT set" if embedded else f"SFT set {data.sft_dir}"
        return data, (f"{where}{name}: manifest hashes, vocabulary, labels and tokenizer check out; "
                      f"{data.loader.steps_per_epoch} steps per epoch, {data.total_steps} steps")
    data = open_stage_data(data_request(data_cfg, 0, world), shard_hashes="all" if deep else "none",
                           hub_wait_s=PREFLIGHT_HUB_WAIT_S, target_tokens=target_tokens)
    hashed = "sizes and SHA-256" if deep else "sizes, from one listing (hashes: --deep)"
    plan = data.plan
    if plan is None:  # prepare_pretrain_data always opens the stage's plan
        raise RuntimeError("pretraining data came without its plan")
    name = "plan" if embedded else f"plan {plan.path}"
    source = data.data_source or {}
    commit = "" if source.get("commit") in (None, "local") else f" at commit {source['commit']}"
    notes = "".join(f"; {note}" for note in data.notes)
    return data, (f"{where}{name} fingerprint {plan.fingerprint[:12]}, {plan.doc['trained_tokens']:,} "
                  f"trained tokens, {data.total_steps} steps; shards from {data.shards_dir}{commit}: every shard "
                  f"it reads matches its manifest's {hashed}; the cache bound holds the shards read at once and "
                  f"those fetched ahead{notes}")
