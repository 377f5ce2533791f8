"""What the stop agreement costs a data-bound step: two gloo ranks (processes of their own), each
step's read taking ``--read-ms`` in the background from the moment the step before was taken, the
stop agreement (``training.callbacks.stop.StopAgreement``) asking for the next step after each.

Two ways for a rank whose read is still running to wait before the agreement asks again: the
agreement's own (``DataLoader.wait_read``: until the read is done, at most 0.2 s) and a fixed
0.2 s tick (what a loop that sleeps ``POLL_S`` between rounds costs). Prints milliseconds per step
for each; the read alone is the floor. ``.venv/bin/python bench/bench_agreement_wait.py``.
"""
from __future__ import annotations

import argparse
import datetime
import socket
import threading
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from ds_trhash.training.callbacks.stop import POLL_S, LauncherWatch, StopAgreement, StopRequests


class _Reads:
    """Each step's read, done ``read_s`` after it began; ``tick``: wait_read sleeps its whole timeout."""

    def __init__(self, read_s: float, tick: bool):
        self.read_s, self.tick, self.done = read_s, tick, {}

    def begin(self, step: int) -> None:
        threading.Timer(self.read_s, self.done.setdefault(step, threading.Event()).set).start()

    def readiness(self, step: int):
        return (0 if self.done[step].is_set() else 1, 0, 0)

    def wait_read(self, step: int, timeout: float) -> None:
        time.sleep(timeout) if self.tick else self.done[step].wait(timeout)

    def agreed(self, step: int, status: int, who: int) -> None:
        """No read here ever fails: the agreed failure status is always 0, nothing to raise."""


def _rank(rank: int, port: int, read_s: float, steps: int, tick: bool, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    reads = _Reads(read_s, tick)
    stop = StopAgreement(StopRequests(), LauncherWatch(), 2, data=reads)
    reads.begin(0)
    stop.wait_for_data(0)
    started = time.perf_counter()
    for step in range(steps):
        reads.begin(step + 1)  # the next step's read begins as this one trains (no compute here)
        stop(step + 1)
    if rank == 0:
        out.put((time.perf_counter() - started) / steps)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read-ms", type=float, default=70.0, help="one step's read (default 70)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for tick, name in ((False, "wait for the read (wait_read)"), (True, f"fixed {POLL_S:g} s tick")):
        out, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, args.read_ms / 1000, args.steps, tick, out)) for r in range(2)]
        for p in procs:
            p.start()
        per_step = out.get(timeout=300)
        for p in procs:
            p.join()
        print(f"{name:32s} {per_step * 1000:6.0f} ms per step (the read alone: {args.read_ms:.0f} ms)")


if __name__ == "__main__":
    main()
