"""The data a launch of a config will read, checked read-only the trainer's way.

Shared by ``preflight`` (which prints the verdict) and ``smoke`` (which needs the full run's
step count and, for pretraining, the plan rows after the ones it trained). The embedded demo
corpus (data paths null) is built in a scratch directory exactly as a launch builds it beside
its output directory; a complete one there is reused, never rewritten.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ds_trhash.training import trainer
from ds_trhash.training.footprint import gib
from ds_trhash.training.stage_inputs import pretrain_inputs


@dataclass(frozen=True)
class ResolvedData:
    data: object  # trainer.StageData (batches unset for pretraining)
    steps_per_epoch: int | None  # SFT
    shards_dir: Path | None  # pretraining
    detail: str


def resolve_stage_data(cfg, model_cfg, world: int, deep: bool, scratch: Path) -> ResolvedData:
    """Raises the trainer's user errors (see trainer.USER_ERRORS) when the data would refuse the launch."""
    embedded = (cfg.data.plan if cfg.data.kind == "pretrain" else cfg.data.sft_dir) is None
    where = f"embedded demo corpus (the launch builds it under {trainer._embedded_root(cfg)}); " if embedded else ""
    data_cfg = dataclasses.replace(cfg, output_dir=str(Path(scratch) / "run")) if embedded else cfg
    if cfg.data.kind == "sft":
        data = trainer.prepare_sft_data(data_cfg, model_cfg, 0, world)
        spe = data.batches.steps_per_epoch
        name = "SFT set" if embedded else f"SFT set {data.sft_dir}"
        return ResolvedData(data, spe, None, f"{where}{name}: manifest hashes, vocabulary, labels and tokenizer "
                                             f"check out; {spe} steps per epoch, {data.total_steps} steps")
    plan_path, shards_dir, tokenizer_dir = trainer.pretrain_paths(data_cfg, 0)
    inputs = pretrain_inputs(cfg, world, plan_path, shards_dir, tokenizer_dir, deep=deep)
    data = trainer.StageData(batches=None, total_steps=inputs.steps, plan=inputs.plan,
                             tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                             tokenizer_sha256=inputs.plan.doc.get("tokenizer_sha256"))
    hashed = "sizes and SHA-256" if deep else "sizes (hashes: --deep)"
    name = "plan" if embedded else f"plan {plan_path}"
    return ResolvedData(data, None, Path(shards_dir),
                        f"{where}{name} fingerprint {inputs.plan.fingerprint[:12]}, "
                        f"{inputs.plan.doc['trained_tokens']:,} trained tokens, {inputs.steps} steps; "
                        f"{inputs.shards} shards ({gib(inputs.shard_bytes)}) match their manifests' {hashed}")
