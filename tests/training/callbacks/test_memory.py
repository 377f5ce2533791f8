"""The micro-batch callback on its own: a retry in place is said once and recorded by rank 0,
written to the monitors and leaves the step's expert-load counts as they were before the
abandoned attempt; an exit is recorded by the rank that failed; an unwritable record never hides
the error being handled."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import torch

from ds_trhash.training.callbacks.base import UpdateCheck
from ds_trhash.training.callbacks.memory import MicroBatchCallback
from ds_trhash.training.memory.record import MICRO_BATCH_FILE
from ds_trhash.training.memory.step import OutOfMemoryExit
from tests.training.callbacks.fakes import Progress


class CountingModel:
    """Expert-load counts that each forward replaces, as the model's do."""

    def __init__(self):
        self.load = torch.zeros(2, 4, dtype=torch.int64)

    def forward(self):
        self.load = self.load + 1

    def expert_load_mark(self):
        return self.load

    def restore_expert_load(self, mark):
        self.load = mark


class Monitor:
    def __init__(self):
        self.written = []

    def write(self, step, values):
        self.written.append((step, values))


def _callback(tmp_path, rank=0):
    run = SimpleNamespace(rank=rank, output_dir=tmp_path, model=CountingModel(), progress=Progress(), monitor=Monitor())
    return MicroBatchCallback(run), run


def _check(step=3):
    return UpdateCheck(step=step, loss=torch.zeros(()), grad_norm=lambda: 0.0, micro_batch=4, rows=8, failed_rank=1)


def test_a_retry_in_place_is_said_and_recorded_once_and_the_counts_go_back_to_the_steps_start(tmp_path):
    cb, run = _callback(tmp_path)
    cb.on_start(None)
    start = run.model.load
    run.model.forward()  # the abandoned attempt counted its routes
    cb.on_retry(None, _check(), micro_batch=2)
    assert torch.equal(run.model.load, start)
    assert run.progress.messages == [
        "step 3: out of device memory at micro-batch 4 on rank 1; every rank abandoned the step and trains it again on "
        "the same rows at micro-batch 2, grad_accum 4 (the global batch unchanged); this size holds from now on"]
    record = json.loads((tmp_path / MICRO_BATCH_FILE).read_text())
    assert (record["micro_batch"], record["grad_accum"]) == (2, 4)
    assert [(e["step"], e["rank"], e["from"], e["to"], e["how"]) for e in record["events"]] == [(3, 1, 4, 2, "in place")]
    assert run.monitor.written == [(3, {"Train/micro_batch": 2, "Train/grad_accum": 4})]


def test_another_rank_restores_its_counts_but_neither_says_nor_records(tmp_path):
    cb, run = _callback(tmp_path, rank=1)
    cb.on_step_end(None, None)
    mark = run.model.load
    run.model.forward()
    cb.on_retry(None, _check(), micro_batch=2)
    assert torch.equal(run.model.load, mark)
    assert run.progress.messages == [] and not (tmp_path / MICRO_BATCH_FILE).exists()


def test_an_exit_is_recorded_by_the_failing_rank_and_other_errors_are_left_alone(tmp_path):
    cb, _ = _callback(tmp_path, rank=1)
    cb.on_error(ValueError("not memory"))
    assert not (tmp_path / MICRO_BATCH_FILE).exists()
    cb.on_error(OutOfMemoryExit(step=5, rank=1, old=4, new=2, grad_accum=4, why="ZeRO 2 reduces inside the backward"))
    events = json.loads((tmp_path / MICRO_BATCH_FILE).read_text())["events"]
    assert [(e["step"], e["rank"], e["from"], e["to"], e["how"]) for e in events] == [(5, 1, 4, 2, "exit")]


def test_an_unwritable_record_is_logged_and_the_exit_goes_on(tmp_path, caplog):
    cb, _ = _callback(tmp_path / "missing" / "run")  # no such folder: the write fails
    with caplog.at_level(logging.ERROR, logger="ds_trhash.memory"):
        cb.on_error(OutOfMemoryExit(step=5, rank=0, old=4, new=2, grad_accum=4, why="ZeRO 2"))
    assert "could not record micro-batch 2" in caplog.text
