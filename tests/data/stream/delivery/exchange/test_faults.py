"""The row exchange under faults, four ranks on two simulated nodes (two ranks each) over gloo,
each rank stepping as training does: its batches, a gradient all-reduce on the default group,
then the stop agreement (``training.callbacks.stop``) naming the next step.

The default group's timeout (3 s) is shorter than one read's budget (6 s), as 30 minutes of
default group are no longer than ``data.hub_wait_minutes`` in production: a rank that waited for
its read outside the step's collectives made the others' all-reduce time out instead of stopping
with the read's own error. And the nodes must run as many ranks each before any group exists."""
import datetime
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.delivery import NodeLayoutError, ReplayReader, RowExchange, agreed_node_count
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.training.callbacks.stop import LauncherWatch, StopAgreement, StopRequests
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus
from tests.data.stream.delivery.exchange.gloo_ranks import run_ranks

NODES, PER_NODE, MICRO, ACCUM = 2, 2, 1, 2
WORLD = NODES * PER_NODE
DEFAULT_GROUP_S, BUDGET_S = 3.0, 6.0
LAYOUTS = {"2 + 1 + 1": [2, 2, 1, 1], "1 + 3": [1, 3, 3, 3]}  # each rank's LOCAL_SIZE
# name: (the rank whose read misbehaves, how: "stall" never returns, "fail" raises; the rank
# that gets Ctrl-C while the others wait for that read, if any; the first step, which read)
SCENARIOS = {"stall": (2, "stall", None, 0, 2), "fail": (0, "fail", None, 0, 2), "stop": (2, "stall", 1, 0, 2),
             "resumed": (0, "fail", None, 1, 1)}  # a resume in the middle of the first chunk, whose read fails


def _layouts(rank):
    """Every rank's NodeLayoutError message (or None) for each unequal layout."""
    found = {}
    for name, counts in LAYOUTS.items():
        try:
            agreed_node_count(WORLD, counts[rank])
            found[name] = None
        except NodeLayoutError as exc:
            found[name] = str(exc)
    return found


def _misbehave(reader, how, release, which):
    """The reader's read number ``which`` stalls until ``release`` is set, or raises."""
    real, calls = reader.read_rows, []

    def read_rows(*args):
        calls.append(1)
        if len(calls) == which:
            if how == "fail":
                raise OSError("disk gone")
            release.wait()
        return real(*args)
    reader.read_rows = read_rows


class _Batches:
    """What the stop agreement asks of the stage's batches (``data.stage.PretrainLoader``: readiness, agreed);
    ``waiting()`` is called when the agreement asks again for one step: some rank still reads."""

    def __init__(self, exchange, waiting=lambda: None):
        self.agreed, self._exchange, self._waiting, self._asked = exchange.agreed, exchange, waiting, []

    def readiness(self, step):
        if self._asked.count(step) == 2:  # asked a third time: every rank waits in the agreement's loop
            self._waiting()
        self._asked.append(step)
        return self._exchange.readiness(step)

    def wait_read(self, step, timeout):  # as RankStream.wait_read over an exchange
        time.sleep(timeout)


def _train(rank, exchange, stop, first, steps):
    """Training's order of collectives: (the step it stopped before, the error and its step)."""
    if stop.wait_for_data(first):  # a stop before the first step: none trained
        return first, None
    for step in range(first, steps):
        try:
            exchange.get(step)
        except Exception as exc:
            return None, (type(exc).__name__, str(exc), step)
        dist.all_reduce(torch.ones(1))  # the step's gradients, on the default group
        if stop(step + 1):
            return step + 1, None
    return steps, None


def _scenario(rank, groups, root, plan, folder, bad, how, signalled, first, which):
    node = rank // PER_NODE
    cache = open_corpus(plan, str(root)).open_cache(folder / f"cache-{node}", 100 * SHARD_BYTES, ranks_on_node=PER_NODE)
    reader, release = ReplayReader(plan, None, 3, cache=cache), threading.Event()
    if rank == bad:
        _misbehave(reader, how, release, which)
    layout = BatchLayout(micro_batch=MICRO, grad_accum=ACCUM, rank=rank, world_size=WORLD)
    exchange = RowExchange(reader, layout, node, NODES, groups[rank % PER_NODE], chunk_rows=16, budget_s=BUDGET_S)
    requests = StopRequests()
    ctrl_c = (lambda: requests.handle(signal.SIGINT)) if rank == signalled else (lambda: None)
    stop = StopAgreement(requests, LauncherWatch(), WORLD, data=_Batches(exchange, ctrl_c))  # Ctrl-C during the wait
    exchange.start(first)
    started = time.monotonic()
    stopped, error = _train(rank, exchange, stop, first, 4)
    took = time.monotonic() - started
    closing = time.monotonic()
    exchange.close()
    closed = time.monotonic() - closing
    stalled = exchange.running  # the stalled read is still in its thread: close did not wait for it
    release.set()
    cache.close()
    return {"stopped": stopped, "error": error, "took": took, "closed": closed, "stalled": stalled,
            "reason": stop.describe() if stopped else None}


def _rank(rank, root, plan, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=DEFAULT_GROUP_S))
    layouts = _layouts(rank)
    groups = [dist.new_group([m * PER_NODE + local for m in range(NODES)], backend="gloo",
                             timeout=datetime.timedelta(seconds=BUDGET_S + 30)) for local in range(PER_NODE)]
    found = {name: _scenario(rank, groups, root, plan, tmp / name, *how) for name, how in SCENARIOS.items()}
    closing = time.monotonic()
    dist.destroy_process_group()
    return {"layouts": layouts, "destroyed": time.monotonic() - closing, **found}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """({scenario: {rank: result}} of four ranks, how long they took to exit once they answered)."""
    tmp = tmp_path_factory.mktemp("faults")
    root = write_corpus(tmp / "corpus")
    found, exited = run_ranks(_rank, WORLD, root, plan_for(root), tmp)
    return {name: {rank: found[rank][name] for rank in found} for name in (*SCENARIOS, "layouts", "destroyed")}, exited


def test_unequal_nodes_are_refused_on_every_rank_naming_each_nodes_ranks(runs):
    found = runs[0]["layouts"]
    for name in LAYOUTS:
        messages = {rank: found[rank][name] for rank in found}
        assert all(messages.values()), messages
        assert len(set(messages.values())) == 1  # the same refusal on every node, at once
        assert f"the nodes run {name} ranks" in messages[0] and "the same slots in the hostfile" in messages[0]


def test_a_read_that_stalls_stops_every_rank_at_one_step_with_the_owners_budget(runs):
    """Rank 2 (node 1, local rank 0) never finishes its second read: every rank raises at that
    chunk's first step once its budget is spent, none in a collective timeout; rank 2 its own
    wait, rank 0 (its group) and ranks 1 and 3 (the other group) that node 1 could not read."""
    found = runs[0]["stall"]
    errors = {rank: r["error"] for rank, r in found.items()}
    assert all(errors.values()) and {step for _, _, step in errors.values()} == {2}, errors
    assert errors[2][:2] == ("ReadTimedOut", "node 1 did not read the rows it owns for steps 2-3 within "
                                             f"data.hub_wait_minutes ({BUDGET_S:g} s)")
    for rank in (0, 1, 3):
        assert errors[rank][:2] == ("PeerStoreUnavailable", "node 1 could not read the rows it owns for steps 2-3 "
                                                            "(its own error is in its log)"), errors
    assert all(BUDGET_S - 1 < r["took"] < BUDGET_S + DEFAULT_GROUP_S for r in found.values()), found


def test_a_read_that_fails_on_one_local_rank_stops_both_groups_at_the_same_step(runs):
    """Only rank 0's read fails (node 0, local rank 0): its group raises as before, and the other
    group (ranks 1 and 3, whose exchange went well) raises at the same step instead of entering
    the step's all-reduce without it."""
    found = runs[0]["fail"]
    errors = {rank: r["error"] for rank, r in found.items()}
    assert {step for _, _, step in errors.values()} == {2}, errors
    assert errors[0][:2] == ("OSError", "disk gone")
    for rank in (1, 2, 3):
        assert errors[rank][:2] == ("PeerReadError", "node 0 could not read the rows it owns for steps 2-3 "
                                                     "(its own error is in its log)"), errors


def test_a_resume_in_the_middle_of_a_chunk_whose_read_fails_stops_every_rank_at_its_first_step(runs):
    found = runs[0]["resumed"]
    errors = {rank: r["error"] for rank, r in found.items()}
    assert {step for _, _, step in errors.values()} == {1}, errors
    assert errors[0][:2] == ("OSError", "disk gone")
    assert {errors[rank][:2] for rank in (1, 2, 3)} == {("PeerReadError", "node 0 could not read the rows it owns for "
                                                                           "steps 0-1 (its own error is in its log)")}


def test_ctrl_c_during_the_wait_is_the_agreed_stop_and_closes_at_once(runs):
    """Ctrl-C on rank 1 while every rank waits for rank 2's stalled read: every rank stops before
    the same step, long before the read's budget; closing sends rank 2's part as "stopped", so no
    exchange waits for the read, which is left in its thread; the process group then goes at once."""
    found, exited = runs[0]["stop"], runs[1]
    assert {r["stopped"] for r in found.values()} == {2} and not any(r["error"] for r in found.values()), found
    assert found[1]["reason"] == "stop requested here: SIGINT"
    assert {found[rank]["reason"] for rank in (0, 2, 3)} == {"stop requested by another rank"}
    assert all(r["took"] < BUDGET_S - 2 for r in found.values()), found
    assert all(r["closed"] < 3 for r in found.values()), found
    assert found[2]["stalled"]
    assert all(seconds < 3 for seconds in runs[0]["destroyed"].values()) and exited < 10, (runs[0]["destroyed"], exited)
