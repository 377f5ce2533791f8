"""What a rank does with a verdict: one line, the ``lost_peer.json`` record, and a hard exit.

It runs on the liveness thread while the training thread may be blocked inside a collective
that will never return, so nothing here waits for the training thread: the line goes to file
descriptor 2 in one ``write`` (no Python stream lock that the training thread could hold), the
record is written atomically (a temporary file renamed over it), NCCL's communicators are
aborted (gloo has nothing to abort: its peers see the closed connections), and ``os._exit`` ends
the process without unwinding the blocked thread. A checkpoint in flight is never published: the
process ends before its rename, or the publish guard (``Liveness.publish_refusal``) refuses it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ds_trhash.io import read_json_object, write_json_atomic
from ds_trhash.training.liveness.verdict import ABORTED, STUCK, Verdict

LOST_PEER_FILE = "lost_peer.json"
ABORT_WAIT_S = 5.0  # NCCL's abort, at most; then the process ends regardless


def describe(verdict: Verdict, rank: int, world: int) -> str:
    """The one line a rank prints for ``verdict`` (seen from ``rank``)."""
    who = f"rank {verdict.rank} (node {verdict.node}, host {verdict.host})"
    where = f"at step {verdict.step} ({verdict.phase})"
    then = f"exiting {verdict.code} without waiting"
    if verdict.reason == ABORTED:
        head = (f"aborting every rank: {verdict.detail}" if verdict.rank == rank
                else f"{who} aborted the run: {verdict.detail}")
        return f"error: rank {rank}/{world}: {head}; exiting {verdict.code}"
    if verdict.itself and verdict.reason != STUCK:
        extra = f"; {verdict.detail}" if verdict.detail else ""
        return (f"error: rank {rank}/{world}: this rank, {who}, was frozen or cut off for {verdict.silent_s:.0f} s "
                f"{where}{extra}: the other ranks have given up on it; {then}, publishing no checkpoint")
    if verdict.reason == STUCK:
        head = f"{who} is stuck in {verdict.phase} at step {verdict.step} for {verdict.silent_s:.0f} s ({verdict.detail})"
    else:
        extra = f"; {verdict.detail}" if verdict.detail else ""
        head = f"lost {who}: silent for {verdict.silent_s:.0f} s, last heard {where}{extra}"
    return (f"error: rank {rank}/{world}: {head}; {then} (the last complete checkpoint is kept: the same command "
            "with --resume auto continues once the node is back)")


def record(verdict: Verdict, launch: str, line: str) -> dict:
    """The ``lost_peer.json`` document (docs/operations.md)."""
    return {"rank": verdict.rank, "node": verdict.node, "host": verdict.host, "step": verdict.step,
            "phase": verdict.phase, "silent_s": round(verdict.silent_s, 1), "reason": verdict.reason,
            "detected_by_rank": verdict.detected_by_rank, "code": verdict.code,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "launch": launch, "message": line}


def write_record(output_dir: Path, verdict: Verdict, launch: str, line: str) -> None:
    """``<output_dir>/lost_peer.json``, atomically. The first verdict of a launch is kept: another
    rank of the same launch that decides later (or the frozen rank when it comes back) leaves it."""
    path = Path(output_dir) / LOST_PEER_FILE
    try:
        if path.is_file() and read_json_object(path).get("launch") == launch:
            return
    except (OSError, ValueError):  # unreadable: written over
        pass
    write_json_atomic(path, record(verdict, launch, line))


def say(line: str) -> None:
    """``line`` on stderr in one write, past any Python-level buffer or lock."""
    os.write(2, (line + "\n").encode("utf-8", "replace"))


def end_process(code: int) -> None:
    """Abort NCCL's communicators where there are any (within ``ABORT_WAIT_S``), flush what can
    be flushed without waiting on another thread, and exit at once with ``code``."""
    worker = threading.Thread(target=_abort_groups, name="liveness-abort", daemon=True)
    worker.start()
    worker.join(ABORT_WAIT_S)
    flusher = threading.Thread(target=_flush, name="liveness-flush", daemon=True)
    flusher.start()
    flusher.join(1.0)
    os._exit(code)


def _abort_groups() -> None:
    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            distributed_c10d._abort_process_group()
    except Exception:  # the process ends next whatever happened here
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe: the line already went out on fd 2 (``say``)
            pass
