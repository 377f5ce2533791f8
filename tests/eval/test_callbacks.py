"""The evaluation callbacks training gets from the entry point: held-out loss and PIQA, each alone."""
import csv
import json

import pytest
import torch
import torch.nn.functional as F

from ds_trhash.eval import callbacks as evcb
from ds_trhash.eval.piqa import PiqaDataError
from ds_trhash.model.loss import IGNORE_INDEX
from ds_trhash.training.callbacks.base import HeldoutResult, PiqaResult
from ds_trhash.training.loop import TrainState
from ds_trhash.training.records.metrics_csv import MetricsWriter
from tests.training.callbacks import fakes


class Bigram(torch.nn.Module):
    """Summed next-token loss of a fixed table: the held-out number is computable by hand."""

    def __init__(self, vocab=4):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, input_ids, labels, reduction="sum"):
        return F.cross_entropy(self.table[input_ids].flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)


class EvalSet:
    def epoch(self, n):
        return [{"input_ids": torch.tensor([[0, 1, 2]]), "labels": torch.tensor([[1, IGNORE_INDEX, 3]])}]


def test_heldout_at_step_0_and_every_epoch_end_into_results_and_metrics(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.csv", rank=0)
    run = fakes.run(tmp_path, engine=Bigram(), eval_batches=EvalSet(), writer=writer)
    cb = evcb.HeldoutCallback.from_run(run)
    told = fakes.told(run)
    cb.on_start(TrainState(step=0, total_steps=4))
    cb.on_start(TrainState(step=2, total_steps=4))  # a resume: the source was evaluated by the first launch
    cb.on_epoch_end(TrainState(step=2, total_steps=4, epoch=0, epochs_done=1))
    assert [(r.step, r.epoch) for r in told.evaluated] == [(0, 0), (2, 1)]
    # uniform logits over 4 tokens: ln 4 per supervised token, 2 supervised tokens
    assert told.evaluated[0] == HeldoutResult(step=0, epoch=0, eval_loss=pytest.approx(torch.log(torch.tensor(4.0)).item()),
                                              eval_ppl=pytest.approx(4.0), eval_tokens=2)
    with open(tmp_path / "metrics.csv", newline="") as fh:
        assert [r["step"] for r in csv.DictReader(fh)] == ["0", "2"]
    assert "held-out at step 0" in run.progress.messages[0]


def test_heldout_stays_off_without_an_eval_partition(tmp_path):
    assert evcb.HeldoutCallback.from_run(fakes.run(tmp_path)) is None


def test_piqa_prepare_refuses_a_malformed_file_before_any_model(tmp_path):
    assert evcb.PiqaCallback.prepare(fakes.config(piqa=None)) is None
    bad = tmp_path / "piqa.jsonl"
    bad.write_text('{"goal": "g", "sol1": "a"}\n')
    with pytest.raises(PiqaDataError, match="missing field 'sol2'"):
        evcb.PiqaCallback.prepare(fakes.config(piqa=str(bad)))


@pytest.mark.parametrize("sft", [True, False])
def test_piqa_schedule_rows_and_barrier(tmp_path, monkeypatch, sft):
    monkeypatch.setattr(evcb, "evaluate_piqa", lambda model, tok, examples, max_len: {
        "acc": 0.5, "acc_norm": 0.75, "n": len(examples), "warning": None})
    barriers, told = [], fakes.Told()
    cb = evcb.PiqaCallback(fakes.Model(), ["e1", "e2"], None, 64, tmp_path, 0, fakes.Progress(), sft=sft,
                           announce=told.on_evaluated, barrier=lambda: barriers.append(1))
    cb.on_start(TrainState(step=0, total_steps=4))
    cb.on_epoch_end(TrainState(step=2, total_steps=4, epoch=0))
    cb.on_end(TrainState(step=4, total_steps=4, epoch=1))
    rows = [json.loads(line) for line in (tmp_path / "piqa.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ([0, 2] if sft else [4])
    assert rows[0]["acc_norm"] == 0.75 and rows[0]["n"] == 2 and len(barriers) == len(rows)
    assert sorted(cb.results) == [r["step"] for r in rows]
    assert told.evaluated == [PiqaResult(step=r["step"], epoch=r["epoch"], acc=0.5, acc_norm=0.75, n=2) for r in rows]


def test_piqa_on_other_ranks_only_waits(tmp_path):
    barriers = []
    cb = evcb.PiqaCallback(fakes.Model(), [], None, 64, tmp_path, 1, fakes.Progress(), sft=True,
                           barrier=lambda: barriers.append(1))
    cb.on_start(TrainState(step=0, total_steps=4))
    assert barriers == [1] and not (tmp_path / "piqa.jsonl").exists()


def test_piqa_resumed_keeps_rows_up_to_its_step_and_evaluates_a_missing_end_once(tmp_path, monkeypatch):
    """Rows written after the checkpoint a run resumes from are dropped (each step recorded once);
    a finished run resumed evaluates the end only when piqa.jsonl lacks it."""
    calls = []

    def fake_piqa(model, tok, examples, max_len):
        calls.append(1)
        return {"acc": 0.5, "acc_norm": 0.75, "n": 2, "warning": None}

    monkeypatch.setattr(evcb, "evaluate_piqa", fake_piqa)
    path = tmp_path / "piqa.jsonl"
    path.write_text("".join(json.dumps({"step": s, "epoch": s // 2, "acc": 0.1 * s}) + "\n" for s in (0, 2, 4))
                    + '{"step": 6, "ep')  # a line cut by a crash
    cb = evcb.PiqaCallback(fakes.Model(), ["e1", "e2"], None, 64, tmp_path, 0, fakes.Progress(), sft=True)
    cb.on_start(TrainState(step=2, total_steps=6))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]
    assert sorted(cb.results) == [0, 2] and calls == []

    finished = evcb.PiqaCallback(fakes.Model(), ["e1", "e2"], None, 64, tmp_path, 0, fakes.Progress(), sft=False)
    state = TrainState(step=2, total_steps=2)
    finished.on_start(state)
    finished.on_end(state)  # step 2 is recorded: not evaluated again
    assert calls == [] and len(path.read_text().splitlines()) == 2
    path.write_text(path.read_text().splitlines()[0] + "\n")  # the end's row never written
    again = evcb.PiqaCallback(fakes.Model(), ["e1", "e2"], None, 64, tmp_path, 0, fakes.Progress(), sft=False)
    again.on_start(state)
    again.on_end(state)
    assert calls == [1] and [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]
