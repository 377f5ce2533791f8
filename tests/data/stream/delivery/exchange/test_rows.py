"""Rows exchanged between nodes (``exchange.rows``): four ranks on two simulated nodes over gloo train
on exactly the rows a direct read gives them, each node's cache fills only the shards it owns,
and a node whose read fails stops every member at the same step."""

import pytest
import torch
import torch.distributed as dist

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.delivery.exchange import PeerReadError, RowExchange, owners
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.delivery import ReplayReader
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus
from tests.data.stream.delivery.exchange.gloo_ranks import run_ranks

NODES, PER_NODE, MICRO, ACCUM = 2, 2, 1, 2
WORLD = NODES * PER_NODE
SCENARIOS = {"whole": (None, 0), "resumed": (None, 3), "broken": (1, 0)}  # name: (failing node, first step)


def _scenario(rank, groups, root, plan, folder, broken, first):
    """One rank's pass over the plan through a RowExchange, every micro-batch compared with a
    direct read: its figures, or the error that stopped it and at which step."""
    node = rank // PER_NODE
    cache = open_corpus(plan, str(root)).open_cache(folder / f"cache-{node}", 100 * SHARD_BYTES, ranks_on_node=PER_NODE)
    reader = ReplayReader(plan, None, 3, cache=cache)
    if broken is not None and node == broken:  # this node's reads fail from the second chunk on
        real, calls = reader.read_rows, []

        def failing(*args):
            calls.append(1)
            if len(calls) > 1:
                raise OSError("disk gone")
            return real(*args)
        reader.read_rows = failing
    layout = BatchLayout(micro_batch=MICRO, grad_accum=ACCUM, rank=rank, world_size=WORLD)
    exchange = RowExchange(reader, layout, node, NODES, groups[rank % PER_NODE], end=5, chunk_rows=16)
    direct = ReplayReader(plan, root, 3)
    steps = direct.num_rows // (MICRO * ACCUM * WORLD)
    exchange.start(first)
    exchange.request_stop()  # what was queued is read again when asked
    exchange.start(first)
    result = {"steps": steps, "chunk_steps": exchange.chunk_steps}
    try:
        for step in range(first, steps):  # the stage ends at 5: step 5 is still the plan's
            for micro, (inputs, labels) in enumerate(exchange.get(step)):
                want = direct.batch(step, micro, exchange.layout)
                assert torch.equal(inputs, want[0]) and torch.equal(labels, want[1]), (rank, step, micro)
                assert inputs.dtype == torch.int64
    except Exception as exc:
        result["error"] = (type(exc).__name__, str(exc), step)
    result["sent"] = exchange.sent_bytes
    exchange.close()
    cache.close()
    return result


def _rank(rank, root, plan, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD)
    groups = [dist.new_group([m * PER_NODE + local for m in range(NODES)], backend="gloo")
              for local in range(PER_NODE)]
    return {name: _scenario(rank, groups, root, plan, tmp / name, broken, first)
            for name, (broken, first) in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(corpus root, plan, tmp folder, {scenario: {rank: result}}): four ranks, every scenario."""
    tmp = tmp_path_factory.mktemp("exchange")
    root = write_corpus(tmp / "corpus")
    plan = plan_for(root)
    found, _ = run_ranks(_rank, WORLD, root, plan, tmp)
    return root, plan, tmp, {name: {rank: found[rank][name] for rank in found} for name in SCENARIOS}


def _cached(folder):
    return {(p.parent.name, p.name) for p in folder.rglob("shard-*.bin")}


def test_every_rank_trains_on_the_rows_a_direct_read_gives_and_each_shard_is_filled_once(runs):
    root, plan, tmp, scenarios = runs
    found = scenarios["whole"]
    assert all("error" not in r for r in found.values()), found
    assert found[0]["steps"] == 6 and found[0]["chunk_steps"] == 2  # three chunks, three exchanges
    table = owners(ReplayReader(plan, root, 0), NODES)
    nodes = [_cached(tmp / "whole" / f"cache-{n}") for n in range(NODES)]
    assert not nodes[0] & nodes[1] and len(nodes[0] | nodes[1]) == 12  # each shard filled by one node only
    for n in range(NODES):
        assert {table[key] for key in nodes[n]} == {n}  # ... its owner
    assert all(r["sent"] > 0 for r in found.values())


def test_a_resume_in_the_middle_of_a_chunk_reads_the_same_rows(runs):
    found = runs[3]["resumed"]
    assert all("error" not in r for r in found.values()), found


def test_a_node_whose_read_fails_stops_every_member_at_the_same_step(runs):
    found = runs[3]["broken"]
    errors = {rank: r.get("error") for rank, r in found.items()}
    assert all(errors.values()), errors
    assert {step for _, _, step in errors.values()} == {2}  # the second chunk's first step, on every rank
    for rank, (kind, message, _) in errors.items():
        if rank // PER_NODE == 1:
            assert (kind, message) == ("OSError", "disk gone")
        else:
            assert kind == PeerReadError.__name__ and "node 1 could not read" in message, message
