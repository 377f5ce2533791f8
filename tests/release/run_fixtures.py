"""A finished (or unfinished) run directory built without a launch: real verified checkpoints of
a tiny model, the run's config.json, and the stage's final/ export and completion record written
by the same functions a launch calls."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ds_trhash.checkpoints import step_dir_name
from ds_trhash.checkpoints.save import save_checkpoint
from ds_trhash.checkpoints.run_lock import RUN_LOCK
from ds_trhash.checkpoints.sync_guard import LOCK_FILE
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.release.lifecycle.final import write_completion
from ds_trhash.release.lifecycle.finish import write_final
from tests import fail_closed

TOTAL = 30


def tiny_state(seed: int = 0, vocab_size: int = 64, max_seq_len: int = 32) -> tuple[TRHashConfig, dict]:
    torch.manual_seed(seed)
    cfg = TRHashConfig.from_preset("tiny", vocab_size=vocab_size, num_layers=1, max_seq_len=max_seq_len)
    return cfg, {k: v.detach().clone() for k, v in TRHashForCausalLM(cfg).state_dict().items()}


def write_step(out: Path, step: int, cfg: TRHashConfig, state: dict, *, pack: int | None = None,
               reason: str = "every_steps", tokenizer: Path | None = None) -> Path:
    def engine(tmp):
        (tmp / "state").mkdir()
        torch.save({"module": state}, tmp / "state" / "mp_rank_00_model_states.pt")

    doc = dict(stage="pretraining", step=step, epoch=0, total_steps=TOTAL, data_cursor=0, world_size=1,
               training_critical={}, plan_fingerprint=None, plan_sha256=None, backends_used={"experts": "pytorch"},
               lora=False, family="language", model_config=cfg.to_dict(),
               tokenizer_dir=str(tokenizer) if tokenizer else None,
               tokenizer_sha256=tokenizer_sha256(tokenizer) if tokenizer else None,
               pack_index=pack, reason=reason)
    return save_checkpoint(out, step, write_engine_state=engine, trainer_state=doc, rank=0, world_size=1)


def make_run(out: Path, steps=(10, 20, 30), *, packs: dict[int, int] | None = None, finished: bool = True,
             keep_unsynced: bool = False, cleanup: str = "off", tokenizer: Path | None = None) -> Path:
    """Checkpoints at ``steps`` (``packs``: step -> pack number), config.json and, when
    ``finished``, final/ of the last step and stage_complete.json. ``tokenizer``: the run's
    (recorded in every checkpoint; the model then has the test tokenizer's 512 entries and a
    context of 128 tokens, enough to generate from)."""
    cfg, state = tiny_state(vocab_size=512 if tokenizer else 64, max_seq_len=128 if tokenizer else 32)
    packs = packs or {}
    for step in steps:
        write_step(out, step, cfg, state, pack=packs.get(step), reason="token pack boundary" if step in packs
                   else ("final" if step == TOTAL else "every_steps"), tokenizer=tokenizer)
    (out / "config.json").write_text(json.dumps({"stage": "pretraining", "checkpoint": {"keep_unsynced": keep_unsynced},
                                                 "training": {"cleanup_after_success": cleanup}}))
    if finished:
        source = out / "checkpoints" / step_dir_name(steps[-1])
        write_final(out, source, log=lambda _: None)
        write_completion(out, stage="pretraining", step=steps[-1], total_steps=TOTAL, source=source, exported=True)
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tree_digest(root: Path) -> dict[str, str]:
    """``fail_closed.tree_digest`` without the lock files (taking a lock is not a change of data)."""
    return {rel: h for rel, h in fail_closed.tree_digest(root).items() if Path(rel).name not in (LOCK_FILE, RUN_LOCK)}
