"""The ranks of a launch: the node's rank count (one lookup for the cache, the resource checks and
the launch plan), whether a collective is due, and the barrier."""
import re
from pathlib import Path

import pytest

from ds_trhash.ranks import ranks_on_node

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env, expected", [
    ({}, 16),  # a plain process: one node holds the whole world
    ({"LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun
    ({"LOCAL_SIZE": "8"}, 8),  # DeepSpeed's launcher sets only this one
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, 2),
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "8"}, 8),
])
def test_ranks_on_node_reads_either_variable(env, expected):
    assert ranks_on_node(16, env) == expected


def test_the_launch_checks_use_the_same_lookup(monkeypatch):
    from ds_trhash.training.preparation import resources

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert resources.local_processes(12) == 3


def _no_collective(*args, **kwargs):
    raise AssertionError("a collective was called without a peer to answer it")


def test_a_single_process_makes_no_collective(tmp_path, monkeypatch):
    """Without a process group, and in a group of one (a `deepspeed` launch on one device), no
    collective is due and the barrier returns at once. (Another test in this worker may have left
    its one-rank group behind: then that group is the one checked.)"""
    import torch.distributed as dist

    from ds_trhash import ranks

    monkeypatch.setattr(dist, "barrier", _no_collective)
    alone = not dist.is_initialized()
    assert ranks.is_multi_rank() is False
    assert ranks.barrier() is None
    if alone:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        assert ranks.is_multi_rank() is False
        ranks.barrier()
    finally:
        if alone:
            dist.destroy_process_group()


def _rank_worker(rank, port, marker, out):
    import time

    import torch.distributed as dist

    from ds_trhash import ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 1:  # late on purpose: rank 0 sees the file only if the barrier waited for it
            time.sleep(0.5)
            marker.write_text("written before the barrier")
        ranks.barrier()
        out[rank] = (ranks.is_multi_rank(), marker.exists())
        ranks.barrier()  # both have looked before rank 1 goes on
    finally:
        dist.destroy_process_group()


def test_with_two_ranks_the_barrier_waits_for_the_late_one(tmp_path):
    import torch.multiprocessing as mp

    from ds_trhash.deepspeed_command import free_port

    out = mp.Manager().dict()
    mp.start_processes(_rank_worker, args=(free_port(), tmp_path / "marker", out), nprocs=2, join=True,
                       start_method="spawn")
    assert dict(out) == {0: (True, True), 1: (True, True)}


# the checks ranks.py answers, as they were written out before it held them
_COPIES = re.compile(r"get_world_size\(\) > 1|is_initialized\(\) and \w*world\w* > 1|def barrier\(|"
                     r"world_size == 1 or not dist\.is_initialized\(\)")


def test_the_distributed_checks_are_defined_once():
    """``is_multi_rank`` and ``barrier`` are the package's only way to ask whether ranks must agree:
    a copy of the check could drift from it (one of them once skipped ``is_available``)."""
    copies = [f"{path.relative_to(REPO)}:{n}" for root in ("ds_trhash", "kernels")
              for path in sorted((REPO / root).rglob("*.py")) if path != REPO / "ds_trhash" / "ranks.py"
              for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if _COPIES.search(line)]
    assert not copies, f"use ds_trhash.ranks.is_multi_rank / barrier: {copies}"
    assert _COPIES.search((REPO / "ds_trhash" / "ranks.py").read_text(encoding="utf-8"))  # the scan finds the original
