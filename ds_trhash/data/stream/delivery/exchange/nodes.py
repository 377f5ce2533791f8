"""The nodes of a job that exchanges rows (``rows``): how many, agreed by every rank, and
which node fills each shard of the plan."""
from __future__ import annotations

import torch.distributed as dist

from ds_trhash.data.stream.delivery.reader import ReplayReader
from ds_trhash.data.stream.types import Key
from ds_trhash.errors import UserError
from ds_trhash.ranks import is_multi_rank


class NodeLayoutError(UserError, ValueError):
    """The ranks are not whole nodes of one rank count: the exchange groups cannot be formed
    (said by every rank: each node's terminal shows it)."""

    per_rank = True


def node_count(world_size: int, per_node: int) -> int:
    """The nodes of a job of ``world_size`` ranks, ``per_node`` on each (``ranks.ranks_on_node``);
    ranks are numbered node after node, as the launchers number them."""
    if per_node < 1 or world_size % per_node:
        raise NodeLayoutError(
            f"{world_size} ranks are not whole nodes of {per_node} rank(s) each (LOCAL_WORLD_SIZE or LOCAL_SIZE "
            "of this node): rows travel between nodes in groups of one rank per node, so every node must run "
            "the same number of ranks; launch as many processes on each node (the same slots in the hostfile)")
    return world_size // per_node


def agreed_node_count(world_size: int, per_node: int) -> int:
    """``node_count`` once every rank agrees on it: each rank's count of ranks on its node
    gathered (one ``all_gather`` on the default group, before any exchange group is formed), so
    that unequal nodes are refused on every node at once, naming each node's count (a node that
    refused alone left the others waiting in ``new_group``)."""
    if not is_multi_rank():
        return node_count(world_size, per_node)
    counts: list = [None] * world_size
    dist.all_gather_object(counts, int(per_node))
    slots, rank = [], 0
    while rank < world_size:  # ranks are numbered node after node: each node's first rank gives its count
        slots.append(max(1, counts[rank]))
        rank += slots[-1]
    if len(set(counts)) > 1 or rank != world_size:
        raise NodeLayoutError(
            f"the nodes run {' + '.join(map(str, slots))} ranks (their hostfile slots, in node order; LOCAL_SIZE or "
            "LOCAL_WORLD_SIZE): rows travel between nodes in groups of one rank per node, so every node must run "
            "the same number of ranks; give every host the same slots in the hostfile")
    return node_count(world_size, per_node)


def owners(reader: ReplayReader, nodes: int) -> dict[Key, int]:
    """The node that fills each shard of the plan: each source's files in plan order dealt out
    round-robin, each source (sorted by name) starting one node later than the one before, so the
    shards read side by side at any point of the plan fall to different nodes."""
    files: dict[str, dict[str, None]] = {}
    for segment in reader.segments:
        for source in segment.sources:
            files.setdefault(source.name, {}).update(dict.fromkeys(source.files))
    return {(name, file): (i + s) % nodes
            for s, name in enumerate(sorted(files)) for i, file in enumerate(files[name])}
