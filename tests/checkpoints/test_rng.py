"""RNG capture/restore reproduces the same draws, per rank on disk, and fails closed."""
import random

import numpy as np
import pytest
import torch

from ds_trhash.checkpoints.rng import (
    RNGStateError,
    capture_rng_state,
    load_rng_state,
    restore_rng_state,
    rng_path,
    save_rng_state,
)


def draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_restore_reproduces_the_same_draws():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.randn()
    state = capture_rng_state()
    expected = draws()
    assert draws() != expected  # the generators moved on
    restore_rng_state(state)
    assert draws() == expected


def test_per_rank_files_round_trip(tmp_path):
    torch.manual_seed(7)
    save_rng_state(tmp_path, rank=0)
    first = torch.rand(2).tolist()
    torch.manual_seed(8)
    save_rng_state(tmp_path, rank=1)
    assert rng_path(tmp_path, 1) == tmp_path / "rng" / "rank_1.pt"
    restore_rng_state(load_rng_state(tmp_path, 0))
    assert torch.rand(2).tolist() == first


def test_missing_rank_file_fails_closed(tmp_path):
    save_rng_state(tmp_path, rank=0)
    with pytest.raises(RNGStateError, match="rank_3.pt is missing.*rank 3.*same world size"):
        load_rng_state(tmp_path, 3)


@pytest.mark.parametrize("piece", ["python", "numpy", "torch_cpu", "cuda"])
def test_missing_piece_fails_closed_and_changes_nothing(piece):
    state = capture_rng_state()
    del state[piece]
    torch.manual_seed(5)
    before = torch.random.get_rng_state().clone()
    with pytest.raises(RNGStateError, match=f"lacks {piece}"):
        restore_rng_state(state)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_foreign_object_refused():
    with pytest.raises(RNGStateError, match="not an RNG state"):
        restore_rng_state({"torch": torch.random.get_rng_state()})


def test_cuda_generator_count_must_match():
    state = capture_rng_state()
    have = len(state["cuda"])
    state["cuda"] = state["cuda"] + [torch.zeros(16, dtype=torch.uint8)]
    with pytest.raises(RNGStateError, match=f"holds {have + 1} CUDA generator.*sees {have} CUDA"):
        restore_rng_state(state)


def test_corrupt_file_refused(tmp_path):
    path = save_rng_state(tmp_path, rank=0)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(RNGStateError, match="cannot read"):
        load_rng_state(tmp_path, 0)
