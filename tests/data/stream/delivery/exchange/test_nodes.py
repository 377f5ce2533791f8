"""The nodes of a job that exchanges rows (``exchange.nodes``): each shard's owner node, a pure
function of the plan, and the node count, refused unless the ranks are whole nodes of one rank
count. The count agreed by every rank of a gloo job is tested in test_faults.py."""

import numpy as np
import pytest

from ds_trhash.data.stream.delivery.exchange import NodeLayoutError, agreed_node_count, node_count, owners
from ds_trhash.data.stream.delivery import ReplayReader
from tests.data.hub_corpus import plan_for, write_corpus


def test_owners_are_a_pure_function_of_the_plan_and_deal_each_source_out_evenly(tmp_path):
    reader = ReplayReader(plan_for(write_corpus(tmp_path / "c")), tmp_path / "c", 0)
    two, again, three = owners(reader, 2), owners(reader, 2), owners(reader, 3)
    assert two == again and len(two) == 12
    for n, table in ((2, two), (3, three)):
        for source in ("a", "b"):
            counts = np.bincount([node for (s, _), node in table.items() if s == source], minlength=n)
            assert counts.max() - counts.min() <= 1, (n, source, counts)
    assert [two[("a", f"shard-{i:05d}.bin")] for i in range(4)] == [0, 1, 0, 1]
    assert [two[("b", f"shard-{i:05d}.bin")] for i in range(4)] == [1, 0, 1, 0]  # the next source starts one node on


def test_the_node_count_needs_whole_nodes_of_one_rank_count():
    assert (node_count(16, 8), node_count(2, 1), node_count(4, 4)) == (2, 2, 1)
    with pytest.raises(NodeLayoutError, match="3 ranks are not whole nodes of 2 rank") as e:
        node_count(3, 2)
    assert "same slots in the hostfile" in str(e.value)


def test_one_rank_counts_its_node_without_a_collective():
    """A one-rank job gathers nothing (with or without a process group): one node, and the same
    refusal when the rank says its node runs more ranks than the job has."""
    assert agreed_node_count(1, 1) == 1
    with pytest.raises(NodeLayoutError, match="1 ranks are not whole nodes of 2 rank"):
        agreed_node_count(1, 2)
