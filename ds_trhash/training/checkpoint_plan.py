"""When a stage writes checkpoints, which ones rotation keeps, and how many exist at once.

One statement of the cadence, used by the trainer's checkpointing callback to decide when to
save and by ``ds-trhash preflight`` / ``smoke`` to size the disk a whole run needs before it
starts: token-pack boundaries (pretraining, refinement) and epoch ends (SFT) are saved and never
rotated away; ``checkpoint.every_steps`` adds saves in between; the last step is always saved;
after each save only the newest ``checkpoint.keep_last`` unprotected ones stay.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ds_trhash.checkpoints import rotation_survivors
from ds_trhash.data.stage import pack_boundaries
from ds_trhash.training.config import TrainConfig


def cadence_reason(step: int, every_steps: int | None, protect: Collection[int]) -> str | None:
    """Why a step inside an epoch is saved: it is protected (a token-pack boundary), or a
    multiple of ``checkpoint.every_steps``; None when it is not saved."""
    if step in protect:
        return "token pack boundary"
    if every_steps and step % every_steps == 0:
        return "every_steps"
    return None


@dataclass(frozen=True)
class CheckpointPlan:
    total_steps: int
    every_steps: int | None = None
    keep_last: int | None = None
    pack_of: Mapping[int, int] = field(default_factory=dict)  # token-pack boundary step -> pack number (1-based)
    epoch_ends: frozenset[int] = frozenset()

    @classmethod
    def for_stage(cls, cfg: TrainConfig, total_steps: int, steps_per_epoch: int | None = None) -> "CheckpointPlan":
        """The plan of a stage with ``total_steps`` optimizer steps (``steps_per_epoch``: SFT)."""
        pack_of: dict[int, int] = {}
        if cfg.data.kind == "pretrain" and cfg.checkpoint.packs:
            pack_of = {b: i + 1 for i, b in enumerate(pack_boundaries(total_steps, cfg.checkpoint.packs))}
        epoch_ends: frozenset[int] = frozenset()
        if cfg.data.kind == "sft" and steps_per_epoch:
            epoch_ends = frozenset(steps_per_epoch * e for e in range(1, cfg.training.epochs + 1)
                                   if steps_per_epoch * e <= total_steps)
        # keep_unsynced: rotation spares what a Hub sync has not verified; without a sync, that is all
        keep_last = None if cfg.checkpoint.keep_unsynced else cfg.checkpoint.keep_last
        return cls(total_steps, cfg.checkpoint.every_steps, keep_last, pack_of, epoch_ends)

    @property
    def protect(self) -> frozenset[int]:
        """Never rotated away: token-pack boundaries and epoch checkpoints."""
        return frozenset(self.pack_of) | self.epoch_ends

    def reason(self, step: int) -> str | None:
        """Why ``step`` is saved (None: it is not), leaving stop signals aside."""
        if step in self.epoch_ends:
            return "end of epoch"
        reason = cadence_reason(step, self.every_steps, self.protect)
        return reason or ("final" if step == self.total_steps else None)

    def save_steps(self, after: int = 0) -> list[int]:
        """Every step later than ``after`` that writes a checkpoint, in order."""
        return [s for s in range(after + 1, self.total_steps + 1) if self.reason(s) is not None]

    def peak_kept(self, after: int = 0, existing: Sequence[int] = ()) -> int:
        """Most checkpoint directories that exist at once from step ``after`` to the end, the one
        being written included; ``existing`` are the complete checkpoints already on disk."""
        present = sorted(existing)
        peak = len(present)
        for step in self.save_steps(after):
            present.append(step)
            peak = max(peak, len(present))
            if self.keep_last:
                keep = rotation_survivors(present, self.keep_last, self.protect, newest_ok=step)
                present = [s for s in present if s in keep]
        return peak
