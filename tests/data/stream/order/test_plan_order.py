"""The plan's global row order on its own: arithmetic on the plan, no shard read, no reader."""
import pytest

from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.data.stream.order import PlanOrder, ReaderError
from tests.data.stream.delivery.test_reader import greedy_wfq, synthetic_plan

ROWS = {"a": 23, "b": 12}


def test_the_order_needs_no_shards_and_is_the_readers():
    doc = synthetic_plan(ROWS, passes={"a": 2}, shard_rows=5)
    order = PlanOrder(doc, seed=7, shuffle_window=8)
    assert order.num_rows == 23 * 2 + 12 and [s.start for s in order.segments] == [0, 35]
    rows = order.global_rows(0, order.num_rows)
    # the reader cuts its batches from exactly these rows, whatever directory it would read
    assert ReplayReader(doc, "/nonexistent", seed=7, shuffle_window=8).global_rows(0, order.num_rows) == rows
    assert order.phase_at(34) == "unique_core" and order.phase_at(35) != "unique_core"


def test_windows_shuffle_within_themselves_and_the_seed_decides():
    doc = synthetic_plan(ROWS, shard_rows=5)
    plain = PlanOrder(doc, seed=3, shuffle_window=0).global_rows(0, 35)
    assert [source for source, _, _ in plain] == greedy_wfq(ROWS)
    shuffled = PlanOrder(doc, seed=3, shuffle_window=8).global_rows(0, 35)
    for start in range(0, 35, 8):  # each window holds the same rows, in another order
        assert sorted(shuffled[start:start + 8]) == sorted(plain[start:start + 8])
    assert shuffled != plain and shuffled == PlanOrder(doc, seed=3, shuffle_window=8).global_rows(0, 35)
    assert PlanOrder(doc, seed=4, shuffle_window=8).global_rows(0, 35) != shuffled


def test_rows_outside_the_plan_and_bad_settings_are_refused():
    doc = synthetic_plan(ROWS, shard_rows=5)
    order = PlanOrder(doc, seed=0, shuffle_window=8)
    with pytest.raises(ReaderError, match="outside the plan's 35 rows; automatic dataset repetition is forbidden"):
        order.global_rows(30, 6)
    with pytest.raises(ReaderError, match="row 35 is outside"):
        order.phase_at(35)
    with pytest.raises(ReaderError, match=r"seed \(-1\) and shuffle_window \(8\) must be >= 0"):
        PlanOrder(doc, seed=-1, shuffle_window=8)
