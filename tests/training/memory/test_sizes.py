"""The fallback micro-batch and a rank's rows of a step cut at it: the same rows, in order."""
import pytest
import torch

from ds_trhash.training.memory.sizes import fitting_sizes, recut, rows_of, smaller_micro_batch


def _step(rows=8, cut=4):
    ids = torch.arange(rows * 3).reshape(rows, 3)
    return [{"input_ids": ids[i:i + cut], "labels": ids[i:i + cut] + 100} for i in range(0, rows, cut)]


def test_the_sizes_that_keep_the_step_exact_and_the_next_smaller_one():
    assert fitting_sizes(12) == [12, 6, 4, 3, 2, 1]
    assert [smaller_micro_batch(m, 12) for m in (12, 6, 4, 3, 2, 1)] == [6, 4, 3, 2, 1, None]
    assert smaller_micro_batch(5, 12) == 4  # from a size that no longer divides: the next that does


def test_recut_keeps_every_row_in_order_and_every_tensor_aligned():
    step = _step()
    finer = recut(step, 2)
    assert [len(mb["input_ids"]) for mb in finer] == [2, 2, 2, 2] and rows_of(finer) == 8
    assert torch.equal(torch.cat([mb["input_ids"] for mb in finer]), torch.cat([mb["input_ids"] for mb in step]))
    assert all(torch.equal(mb["labels"], mb["input_ids"] + 100) for mb in finer)
    assert recut(step, None) is step and recut(step, 4) is step  # the cut's own size: untouched
    with pytest.raises(ValueError, match="micro-batch 3 does not divide this rank's 8 rows"):
        recut(step, 3)
