"""best/ selection: the rule, the record of every candidate, atomic replacement."""

import json

import pytest

from ds_trhash.checkpoints.selection import Candidate, choose, publish


def _cand(tmp_path, epoch, step, loss):
    d = tmp_path / "checkpoints" / f"step_{step:08d}"
    (d / "state").mkdir(parents=True)
    (d / "state" / "weights.pt").write_text(f"epoch {epoch}")
    return Candidate(epoch=epoch, step=step, checkpoint=str(d), eval_loss=loss, eval_ppl=None,
                     eval_tokens=10, train_loss=None)


def test_rules(tmp_path):
    c = [_cand(tmp_path, 1, 10, 1.5), _cand(tmp_path, 2, 20, 1.2), _cand(tmp_path, 3, 30, 1.2)]
    assert choose(c, "min_eval_loss").step == 20  # ties go to the earlier checkpoint
    assert choose(c, "last").step == 30
    with pytest.raises(ValueError, match="allowed: min_eval_loss, last"):
        choose(c, "best_piqa")
    with pytest.raises(ValueError, match="eval.select=last"):
        choose([Candidate(1, 10, "x", None, None, None, None)], "min_eval_loss")


def test_publish_replaces_best_and_records_every_candidate(tmp_path):
    first = _cand(tmp_path, 1, 10, 1.5)
    publish(tmp_path, [first], "min_eval_loss")
    assert (tmp_path / "best" / "state" / "weights.pt").read_text() == "epoch 1"
    second = _cand(tmp_path, 2, 20, 1.1)
    publish(tmp_path, [first, second], "min_eval_loss")
    assert (tmp_path / "best" / "state" / "weights.pt").read_text() == "epoch 2"
    doc = json.loads((tmp_path / "selection.json").read_text())
    assert doc["rule"] == "min_eval_loss" and doc["selected"]["epoch"] == 2
    assert [c["eval_loss"] for c in doc["candidates"]] == [1.5, 1.1]
    assert not (tmp_path / "best.tmp").exists() and not (tmp_path / "best.old").exists()
