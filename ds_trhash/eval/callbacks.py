"""Evaluation during training, as training callbacks: held-out loss and zero-shot PIQA.

The training package defines the callback interface and never imports this module; the entry
point that composes a launch (``ds_trhash.run``) puts these callbacks into its list. Both send
each result, typed (``HeldoutResult``, ``PiqaResult``), to every callback of the launch
(``RunContext.evaluated``): the epoch checkpoint records it and the selection of ``best/`` reads it.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from ds_trhash.data.formats.tokenizer import load_tokenizer
from ds_trhash.eval.heldout import Scored, heldout_loss
from ds_trhash.eval.piqa import PiqaCountWarning, PiqaExample, TextEncoder, evaluate_piqa, read_piqa
from ds_trhash.io import write_text_atomic
from ds_trhash.ranks import is_multi_rank
from ds_trhash.training.callbacks.base import (
    EVAL,
    Builder,
    Callback,
    EvalResult,
    HeldoutResult,
    PiqaResult,
    RunContext,
    TrainState,
)

if TYPE_CHECKING:  # type names only (of training, what its callback interface names)
    import torch

    from ds_trhash.data.sft.dataset import SFTBatches
    from ds_trhash.training.callbacks.base import MetricsWriter, Progress, TrainConfig

PIQA_RESULTS = "piqa.jsonl"
Announce = Callable[[TrainState, EvalResult], None]  # RunContext.evaluated: to every callback


def _nobody(state: TrainState, result: EvalResult) -> None:
    """A callback built alone (tests) tells no one."""


class HeldoutCallback(Callback):
    """Held-out loss at the start (the source checkpoint, step 0) and at every epoch boundary,
    on every rank (each scores its share; the loss is reduced over ranks)."""

    phase = EVAL

    def __init__(self, model: Scored, eval_batches: SFTBatches, device: torch.device, writer: MetricsWriter,
                 progress: Progress, announce: Announce = _nobody) -> None:
        self.model, self.eval_batches, self.device = model, eval_batches, device
        self.writer, self.progress, self.announce = writer, progress, announce

    @classmethod
    def from_run(cls, run: RunContext) -> "HeldoutCallback | None":
        if run.eval_batches is None:  # eval.heldout off, or a stage without a held-out partition
            return None
        return cls(run.engine, run.eval_batches, run.device, run.writer, run.progress, run.evaluated)

    def evaluate(self, state: TrainState) -> HeldoutResult:
        state.pause("eval")  # out of the steady tokens/s
        measured = heldout_loss(self.model, self.eval_batches.epoch(0), self.device)
        result = HeldoutResult(step=state.step, epoch=state.epochs_done, **measured)
        self.writer.write(step=state.step, epoch=state.epochs_done, eval_loss=result.eval_loss,
                          eval_tokens=result.eval_tokens)
        self.progress.message(
            f"held-out at step {state.step} (epoch {state.epochs_done}): loss {result.eval_loss:.4f} "
            f"ppl {result.eval_ppl:.2f} over {result.eval_tokens:,} supervised tokens")
        self.announce(state, result)
        return result

    def on_start(self, state: TrainState) -> None:
        if state.step == 0:
            self.evaluate(state)

    def on_epoch_end(self, state: TrainState) -> None:
        self.evaluate(state)


class PiqaCallback(Callback):
    """Zero-shot PIQA (docs/contracts.md, "Evaluation") on rank 0: the SFT source at step 0 and
    every epoch end, or the end of a pretraining/refinement stage. Rows go to ``piqa.jsonl``
    beside metrics.csv; the other ranks wait at a barrier."""

    phase = EVAL

    run_files = (PIQA_RESULTS,)

    def __init__(self, model: torch.nn.Module, examples: list[PiqaExample], tokenizer: TextEncoder, max_len: int,
                 output_dir: Path, rank: int, progress: Progress, sft: bool, announce: Announce = _nobody,
                 barrier: Callable[[], object] = lambda: None) -> None:
        self.model, self.examples, self.tokenizer, self.max_len = model, examples, tokenizer, max_len
        self.output_dir, self.rank, self.progress, self.sft = Path(output_dir), rank, progress, sft
        self.results: dict[int, dict] = {}  # the rows of piqa.jsonl by step (rank 0)
        self.announce, self.barrier = announce, barrier

    @classmethod
    def prepare(cls, cfg: TrainConfig) -> Builder | None:
        """Reads ``eval.piqa`` before the model exists: a malformed file refuses the launch."""
        if not cfg.eval.piqa:
            return None
        examples = read_piqa(cfg.eval.piqa)

        def build(run: RunContext) -> "PiqaCallback":
            if run.tokenizer_dir is None:  # a launch with PIQA names its tokenizer (data.tokenizer)
                raise RuntimeError("eval.piqa needs data.tokenizer")
            return cls(run.model, examples, load_tokenizer(run.tokenizer_dir), run.model_config.max_seq_len,
                       run.output_dir, run.rank, run.progress, sft=run.cfg.data.kind == "sft",
                       announce=run.evaluated, barrier=run.barrier)

        return build

    def evaluate(self, state: TrainState) -> None:
        state.pause("piqa")  # out of the steady tokens/s (every rank waits for rank 0's scoring)
        if self.rank == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PiqaCountWarning)  # reported in the result's "warning"
                result = evaluate_piqa(self.model, self.tokenizer, self.examples, max_len=self.max_len)
            measured = PiqaResult(step=state.step, epoch=state.epochs_done, acc=result["acc"],
                                  acc_norm=result["acc_norm"], n=result["n"], warning=result.get("warning"))
            row = self.results[state.step] = measured.record()
            with open(self.output_dir / PIQA_RESULTS, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            self.progress.message(f"PIQA at step {state.step} (epoch {state.epochs_done}): acc {result['acc']:.4f} "
                                  f"acc_norm {result['acc_norm']:.4f} over {result['n']} examples")
            self.announce(state, measured)
        self.barrier()

    def _keep_rows_up_to(self, step: int) -> None:
        """A resume at ``step`` (-1: a fresh start): rows of later steps (evaluated before a crash,
        after the checkpoint) are dropped, as metrics.csv drops its rows, so each step is evaluated and
        recorded once; the kept ones are known again (``_recorded``)."""
        path = self.output_dir / PIQA_RESULTS
        if not path.is_file():
            return
        before, rows = path.read_text(encoding="utf-8"), []
        for line in before.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
        for row in rows:
            self.results[row["step"]] = row
        text = "".join(json.dumps(row) + "\n" for row in rows)
        if text != before:
            write_text_atomic(path, text)

    def on_start(self, state: TrainState) -> None:
        if self.rank == 0:  # step 0 is a fresh start: rows of an attempt that left no checkpoint go
            self._keep_rows_up_to(state.step if state.step > 0 else -1)
        if self.sft and state.step == 0:
            self.evaluate(state)

    def on_epoch_end(self, state: TrainState) -> None:
        if self.sft:
            self.evaluate(state)

    def on_end(self, state: TrainState) -> None:
        # a finished run resumed (RESUME=auto after the end) evaluates only if the end was cut short
        if not self.sft and state.step == state.total_steps and not self._recorded(state.step):
            self.evaluate(state)

    def _recorded(self, step: int) -> bool:
        """Whether ``piqa.jsonl`` holds ``step`` (rank 0 knows; the others follow it)."""
        recorded = [step in self.results] if self.rank == 0 else [False]
        if is_multi_rank():
            dist.broadcast_object_list(recorded, src=0)
        return recorded[0]


EVAL_CALLBACKS = (HeldoutCallback, PiqaCallback)
