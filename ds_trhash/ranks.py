"""How many ranks run on this node: the one lookup every package uses.

DeepSpeed's launcher exports ``LOCAL_SIZE``, torchrun ``LOCAL_WORLD_SIZE``; a plain single
process has neither and is alone on its node unless the world says otherwise. Reading only one
of the two made the node cache's checks use the global world size on several nodes.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

NODE_RANK_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def ranks_on_node(world: int, env: Mapping[str, str] | None = None) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``, else ``world`` (one node)."""
    env = os.environ if env is None else env
    for name in NODE_RANK_VARIABLES:
        value = env.get(name)
        if value:
            return int(value)
    return world
