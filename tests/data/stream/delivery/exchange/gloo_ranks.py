"""Ranks of a small gloo job in processes of their own, for the row exchange's tests."""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback


def _rank(target, rank, args, out):
    """Forked from a fresh interpreter (the forkserver): a fork of the pytest worker could hold a
    process group of another test already."""
    try:
        out.put((rank, target(rank, *args)))
    except Exception:
        out.put((rank, traceback.format_exc()))


def run_ranks(target, world: int, *args) -> tuple[dict, float]:
    """``target(rank, *args)`` on each of ``world`` ranks: ({rank: its result}, seconds from the
    last result to the last exit), every rank's traceback failing the caller, every process
    exited 0."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "ds_trhash.data.stream.delivery.exchange", "tests.data.hub_corpus"])
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(target, r, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    found = dict(out.get(timeout=300) for _ in procs)
    answered = time.monotonic()
    for p in procs:
        p.join(30)
    exited = time.monotonic() - answered
    for rank, result in found.items():
        assert isinstance(result, dict), result
    assert not [p for p in procs if p.exitcode != 0]
    return found, exited
