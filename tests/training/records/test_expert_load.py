"""expert_load.csv: the model counts each layer's token routes (once per training forward, on the
device), ranks sum them, rank 0 appends one row per layer; a resume drops rows after its step."""
import csv

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.training.records.expert_load import ExpertLoadWriter, columns, gather_expert_load, load_shares
from ds_trhash.training.records.metrics_csv import MetricsError

CFG = TRHashConfig.from_preset("tiny")  # 4 layers, 4 experts


def _model():
    torch.manual_seed(0)
    model = TRHashForCausalLM(CFG)
    model.track_expert_load = True
    return model


def _expected(model, ids):
    """Each layer's route table read directly: expert e of layer l gets every (token, route) sent to it."""
    flat = ids.reshape(-1)
    return torch.stack([torch.bincount(engine.route_table[:, flat].reshape(-1), minlength=CFG.num_experts)
                        for engine in model.engines()])


def test_counts_are_the_route_table_applied_to_the_tokens_of_training_forwards():
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    more = torch.randint(0, CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).backward()
    with torch.no_grad():
        model(more, labels=more)  # evaluation forwards are not training load
    model(more, labels=more).backward()
    counts = model.take_expert_load()
    assert counts.shape == (CFG.num_layers, CFG.num_experts) and counts.dtype == torch.int64
    assert torch.equal(counts, _expected(model, ids) + _expected(model, more))
    assert counts.sum(dim=1).tolist() == [2 * (ids.numel() + more.numel())] * CFG.num_layers  # top-2
    assert model.take_expert_load() is None  # taken: the next interval starts empty


def test_recomputed_layers_are_not_counted_twice():
    model = _model()
    model.set_activation_checkpointing("full")
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).backward()  # backward re-runs every layer's forward
    assert torch.equal(model.take_expert_load(), _expected(model, ids))


def test_single_process_gather_and_shares():
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    model(ids, labels=ids).backward()
    counts = gather_expert_load(model, torch.device("cpu"))
    shares = load_shares(counts)
    assert len(shares) == CFG.num_layers * CFG.num_experts
    assert sum(shares[f"Experts/layer_00/expert_{e}"] for e in range(CFG.num_experts)) == pytest.approx(1.0)
    assert shares["Experts/layer_03/expert_1"] == pytest.approx(float(counts[3, 1]) / float(counts[3].sum()))
    assert gather_expert_load(model, torch.device("cpu")) is None


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def test_rows_per_layer_and_a_resume_drops_later_steps(tmp_path):
    path = tmp_path / "expert_load.csv"
    writer = ExpertLoadWriter(path, num_experts=2, rank=0)
    for step in (1, 2, 4, 6):
        writer.write(step, step - 1 if step < 3 else step - 2, torch.tensor([[step, 10], [3, step]]))
    writer.close()
    rows = _rows(path)
    assert rows[0] == list(columns(2)) == ["step", "from_step", "layer", "expert_0", "expert_1"]
    assert rows[1:3] == [["1", "0", "0", "1", "10"], ["1", "0", "1", "3", "1"]]
    resumed = ExpertLoadWriter(path, num_experts=2, rank=0, resume_step=2)  # the checkpoint at step 2
    resumed.write(3, 2, torch.tensor([[1, 1], [2, 2]]))
    resumed.close()
    assert [(r[0], r[1]) for r in _rows(path)[1:]] == [("1", "0"), ("1", "0"), ("2", "1"), ("2", "1"),
                                                       ("3", "2"), ("3", "2")]
    fresh = ExpertLoadWriter(path, num_experts=2, rank=0, resume_step=-1)  # a fresh start over a dead attempt
    fresh.close()
    assert _rows(path) == [list(columns(2))]


def test_another_expert_count_is_refused_and_the_file_kept(tmp_path):
    path = tmp_path / "expert_load.csv"
    path.write_text("step,from_step,layer,expert_0,expert_1\n1,0,0,5,3\n")
    before = path.read_bytes()
    with pytest.raises(MetricsError, match="existing header differs"):
        ExpertLoadWriter(path, num_experts=4, rank=0)
    assert path.read_bytes() == before


def test_other_ranks_write_nothing_and_wrong_shapes_are_refused(tmp_path):
    writer = ExpertLoadWriter(tmp_path / "expert_load.csv", num_experts=4, rank=1)
    writer.write(1, 0, torch.zeros(2, 4, dtype=torch.long))
    assert not (tmp_path / "expert_load.csv").exists()
    with pytest.raises(ValueError, match=r"must be \[layers, 4\], got \[2, 3\]"):
        writer.write(1, 0, torch.zeros(2, 3, dtype=torch.long))
