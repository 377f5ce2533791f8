"""The micro-batch in force: an out-of-memory step's new size said, recorded and held.

The loop abandons a step that ran out of memory on any rank and trains it again at the next
smaller micro-batch (``loop.agreed_step``); this callback says so (one line, rank 0), records
the change durably in ``micro_batch.json`` (``memory.record``) so that the next launch of the
run keeps it, writes it to the DeepSpeed monitors (``Train/micro_batch``, ``Train/grad_accum``), and keeps the step's expert-load counts as they were before the abandoned attempt.
Where the ranks could not retry in place (``OutOfMemoryExit``), the rank that failed records the
change before every rank stops (exit 77).
"""
from __future__ import annotations

import logging

import torch

from ds_trhash.training.callbacks.base import Callback, RunContext, TrainState, UpdateCheck
from ds_trhash.training.memory.record import MICRO_BATCH_FILE, record_change
from ds_trhash.training.memory.step import OutOfMemoryExit

log = logging.getLogger("ds_trhash.memory")


class MicroBatchCallback(Callback):
    run_files = (MICRO_BATCH_FILE,)

    def __init__(self, run: RunContext):
        self.run = run
        self._mark: torch.Tensor | None = None  # the expert-load counts at the step's start

    @classmethod
    def from_run(cls, run: RunContext) -> "MicroBatchCallback":
        return cls(run)

    def _mark_step_start(self) -> None:
        model = self.run.model
        self._mark = model.expert_load_mark() if hasattr(model, "expert_load_mark") else None

    def on_start(self, state: TrainState) -> None:
        self._mark_step_start()

    def on_step_end(self, state: TrainState, metrics: object) -> None:
        self._mark_step_start()

    def on_retry(self, state: TrainState, check: UpdateCheck, micro_batch: int) -> None:
        if hasattr(self.run.model, "restore_expert_load"):
            self.run.model.restore_expert_load(self._mark)
        grad_accum = check.rows // micro_batch
        line = (f"step {check.step}: out of device memory at micro-batch {check.micro_batch} on rank "
                f"{check.failed_rank}; every rank "
                f"abandoned the step and trains it again on the same rows at micro-batch {micro_batch}, "
                f"grad_accum {grad_accum} (the global batch unchanged); this size holds from now on")
        if self.run.rank == 0:
            record_change(self.run.output_dir, step=check.step, rank=check.failed_rank or 0, old=check.micro_batch,
                          new=micro_batch, grad_accum=grad_accum, how="in place")
            self.run.progress.message(line)
        if self.run.monitor is not None:  # TensorBoard / W&B / CSV monitors, when configured (rank 0 writes)
            self.run.monitor.write(check.step, {"Train/micro_batch": micro_batch, "Train/grad_accum": grad_accum})

    def on_error(self, exc: BaseException) -> None:
        """The rank that ran out of memory where no retry in place is possible: its record, first."""
        if not isinstance(exc, OutOfMemoryExit):
            return
        try:
            record_change(self.run.output_dir, step=exc.step, rank=exc.rank, old=exc.old, new=exc.new,
                          grad_accum=exc.grad_accum, how="exit")
        except OSError as err:  # never hide the error being handled
            log.error("could not record micro-batch %d in %s: %s", exc.new, self.run.output_dir, err)
