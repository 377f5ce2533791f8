"""The stage guard of a launch (docs/contracts.md §3), before the model exists: which checkpoint
may start this stage, with data tokenized like the checkpoint's."""
from __future__ import annotations

import os

from ds_trhash.checkpoints.stages import SourceRecord, StageError, check_launch
from ds_trhash.checkpoints.weights import read_source_metadata
from ds_trhash.data.stage import StageData, unique_core_fingerprint, validate_refinement
from ds_trhash.training import config as tcfg


def check_tokenizer_identity(source_meta: dict, data: StageData, init_dir: str | os.PathLike) -> None:
    """The data of the next stage must be tokenized exactly like the source model's: token ids
    (and with them the persisted routes) mean nothing under another tokenizer."""
    theirs, ours = source_meta.get("tokenizer_sha256"), data.tokenizer_sha256
    if theirs and ours and theirs != ours:
        raise StageError(
            f"the data of this launch was tokenized with tokenizer {ours[:12]}…, but {init_dir} was trained with "
            f"tokenizer {theirs[:12]}…; rebuild the data with the checkpoint's tokenizer")


def guard_stage(cfg: tcfg.TrainConfig, init_dir: str | None, data: StageData, resuming: bool) -> SourceRecord | None:
    """The source checkpoint's record when the transition is allowed (None from scratch); raises
    StageError otherwise. A resume re-checks the record of the first launch."""
    if init_dir is None:
        record, source_meta = None, {}
    else:
        source_meta = read_source_metadata(init_dir)
        record = SourceRecord.from_mapping(source_meta, path=str(init_dir))
    if record is None and resuming:
        return None
    if record is not None and init_dir is not None:  # a record is read from init_dir
        check_tokenizer_identity(source_meta, data, init_dir)
    check_launch(
        cfg.stage, record,
        source_stage_flag=cfg.source_stage,
        target_plan_doc=data.plan.doc if data.plan is not None else None,
        source_plan_doc=source_meta.get("plan_doc"),
        fresh_optimizer=True,
        family=cfg.model.family,
        validate_refinement=validate_refinement,
        plan_fingerprint=unique_core_fingerprint,
    )
    return record
