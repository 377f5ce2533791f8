"""Checkpoints written off the training thread: the step pays for a copy to host memory only.

``save.save_checkpoint`` writes, fsyncs and hashes the whole state before training goes on
(seconds per checkpoint at 200m on a GPU: docs/performance.md, "Checkpoint save"). Here the
training thread does only the collective part: every rank prepares ``step_<N>.tmp`` together,
the engine's state is captured as a copy in host memory (``snapshot.host_snapshot``, through the
capturing checkpoint engine the trainer installs), the RNG state is written, and a thread per
rank takes over:

1. it writes the captured files, hashing their bytes as they go (no second read) and fsyncing
   each, then records their sizes and SHA-256 in ``.written/rank_<r>.json`` (or the error in
   ``.written/rank_<r>.failed``);
2. on rank 0 it then waits for every rank's record, merges them, hashes what DeepSpeed wrote
   directly (``latest``, the recovery scripts) and publishes exactly as a synchronous save does
   (``save._finalize``: trainer state, manifest last, fsync, one rename).

So the guarantees stay those of the synchronous save: a checkpoint is visible only once every
file of every rank is written, hashed and synced; a crash (kill -9) at any point leaves at most
a ``*.tmp`` directory that listings ignore and a resume never picks. At most one save is in
flight per rank: a second ``start`` first waits for the first. A failure in the thread is kept
and raised on the training thread by the next ``poll``, ``start`` or ``wait``: an
``OSError`` (a full or read-only disk) as itself, anything else as a ``CheckpointError``
naming the checkpoint; the caller waits (``wait``) at the end of the stage,
on a stop and before anything reads the checkpoint it just saved.

No collective runs off the training thread: rank 0 learns that the other ranks are done from
their records on the (shared) checkpoint filesystem, which the synchronous save already
requires (it checks every rank's RNG file there).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from ds_trhash.checkpoints.rng import save_rng_state
from ds_trhash.checkpoints.save import _finalize, _prepare, _state_doc, never_refuse
from ds_trhash.checkpoints.state import CheckpointError, TrainerState, rng_path
from ds_trhash.io import fsync_path, read_json_object, sha256_file, write_json_atomic

WRITTEN = ".written"  # per-rank records inside step_<N>.tmp; removed before the manifest
WAIT_FOR_RANKS_S = 1800.0


@dataclass(frozen=True)
class PendingFile:
    """One file of the engine's state, captured in host memory, written by the thread."""

    path: Path
    state: object
    zipfile: bool = True  # torch.save's _use_new_zipfile_serialization, as the engine asked


@dataclass(frozen=True)
class Finished:
    """A save that completed on this rank (on rank 0: published)."""

    step: int
    path: Path
    on_step_s: float  # training-thread time of start()
    background_s: float  # the thread's time: write, hash, fsync (rank 0: and publish)


class _HashingWriter:
    """A binary file that hashes what passes through it (torch.save writes into it)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.digest, self.size = fh, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self.fh.write(view)

    def flush(self) -> None:
        self.fh.flush()


def write_torch_file(pending: PendingFile) -> dict[str, Any]:
    """Write one captured state with ``torch.save``; fsynced; {size, sha256} of its bytes."""
    pending.path.parent.mkdir(parents=True, exist_ok=True)
    with open(pending.path, "wb") as fh:
        out = _HashingWriter(fh)  # torch.save needs only write and flush
        torch.save(pending.state, cast(BinaryIO, out), _use_new_zipfile_serialization=pending.zipfile)
        fh.flush()
        os.fsync(fh.fileno())
    return {"size": out.size, "sha256": out.digest.hexdigest()}


def _hash_synced(path: Path) -> dict[str, Any]:
    fsync_path(path)
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def _record(tmp: Path, rank: int, suffix: str) -> Path:
    return tmp / WRITTEN / f"rank_{rank:05d}.{suffix}"


@dataclass
class _Job:
    step: int
    tmp: Path
    final: Path
    doc: dict[str, Any]
    pending: list[PendingFile]
    on_step_s: float
    thread: threading.Thread | None = None
    error: BaseException | None = None
    background_s: float = 0.0


class BackgroundSaver:
    """This rank's background checkpoint writer (see the module docstring).

    ``write_file`` writes one ``PendingFile`` and returns its {size, sha256} (tests pass a slow
    one); ``after_write(step)`` runs in the thread once this rank's files are on disk and before
    the checkpoint is complete (the crash-safety tests kill the process there); ``may_publish``
    is asked on rank 0 right before the rename (a reason refuses the publish: ``save._finalize``).
    """

    def __init__(self, rank: int, world_size: int, *,
                 write_file: Callable[[PendingFile], Mapping[str, Any]] = write_torch_file,
                 after_write: Callable[[int], Any] = lambda step: None,
                 wait_for_ranks_s: float = WAIT_FOR_RANKS_S,
                 may_publish: Callable[[], str | None] = never_refuse):
        self.rank, self.world_size = rank, world_size
        self.may_publish = may_publish
        self.write_file, self.after_write = write_file, after_write
        self.wait_for_ranks_s = wait_for_ranks_s
        self._job: _Job | None = None

    @property
    def in_flight(self) -> int | None:
        """The step being written, or None."""
        return self._job.step if self._job is not None else None

    def start(self, output_dir: str | os.PathLike, step: int, *,
              capture: Callable[[Path], list[PendingFile]], trainer_state: TrainerState | Mapping[str, Any],
              barrier: Callable[[], Any] = lambda: None, rng_state: dict[str, Any] | None = None) -> Finished | None:
        """Collective, like ``save_checkpoint``: capture step ``step`` on the training thread and
        hand the writing to a thread. Returns the previous save if this call had to finish it."""
        previous = self.wait()
        t0 = time.perf_counter()
        doc = _state_doc(trainer_state)
        final, tmp = _prepare(output_dir, step, doc, self.rank, self.world_size, barrier)
        pending = list(capture(tmp))
        save_rng_state(tmp, self.rank, rng_state)
        job = _Job(step, tmp, final, doc, pending, on_step_s=0.0)
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"checkpoint-{step}", daemon=True)
        job.on_step_s = time.perf_counter() - t0
        self._job = job
        job.thread.start()
        return previous

    def poll(self) -> Finished | None:
        """The in-flight save if it has completed (its failure raised), else None; never blocks."""
        job = self._job
        if job is None or job.thread is None or job.thread.is_alive():
            return None
        return self._collect(job)

    def wait(self) -> Finished | None:
        """Block until the in-flight save completed; None when there was none. Raises its failure."""
        job = self._job
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()
        return self._collect(job)

    def _collect(self, job: _Job) -> Finished:
        self._job = None
        error = job.error
        if isinstance(error, OSError):
            raise error  # the disk (full, read-only, failing): the launcher names it in one line per rank
        if error is not None:
            raise CheckpointError(
                f"writing checkpoint {job.final.name} in the background failed on rank {self.rank}: "
                f"{type(error).__name__}: {error}; it was not published (the previous checkpoint stays the "
                f"newest; {job.tmp.name} is left for inspection and removed by the next rotation)"
            ) from error
        return Finished(job.step, job.final, job.on_step_s, job.background_s)

    # ------------------------------------------------------------------ the thread

    def _run(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            entries = self._write_own(job)
            if self.rank == 0:
                _finalize(job.tmp, job.final, job.doc, self.world_size, known=self._merge(job.tmp, entries),
                          may_publish=self.may_publish)
        except BaseException as exc:  # kept for the training thread
            job.error = exc
        job.background_s = time.perf_counter() - t0

    def _write_own(self, job: _Job) -> dict[str, Any]:
        try:
            entries = {p.path.relative_to(job.tmp).as_posix(): dict(self.write_file(p)) for p in job.pending}
            job.pending.clear()  # the host copy is released as soon as it is on disk
            rng = rng_path(job.tmp, self.rank)
            entries[rng.relative_to(job.tmp).as_posix()] = _hash_synced(rng)
            self.after_write(job.step)
        except BaseException as exc:
            _record(job.tmp, self.rank, "failed").parent.mkdir(exist_ok=True)
            write_json_atomic(_record(job.tmp, self.rank, "failed"),
                              {"error": f"{type(exc).__name__}: {exc}", "errno": getattr(exc, "errno", None)})
            raise
        if self.rank != 0:
            _record(job.tmp, self.rank, "json").parent.mkdir(exist_ok=True)
            write_json_atomic(_record(job.tmp, self.rank, "json"), entries)
        return entries

    def _merge(self, tmp: Path, own: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: every rank's entries, once each rank recorded its files (or its failure)."""
        entries, waiting = dict(own), set(range(1, self.world_size))
        deadline = time.monotonic() + self.wait_for_ranks_s
        while waiting:
            for r in sorted(waiting):
                if _record(tmp, r, "failed").is_file():
                    failed = read_json_object(_record(tmp, r, "failed"), CheckpointError)
                    message = f"rank {r} failed to write its part of {tmp.name}: {failed.get('error')}"
                    if isinstance(failed.get("errno"), int):  # a disk error there is one here too
                        raise OSError(failed["errno"], message)
                    raise CheckpointError(message)
                if _record(tmp, r, "json").is_file():
                    entries.update(read_json_object(_record(tmp, r, "json"), CheckpointError))
                    waiting.discard(r)
            if waiting and time.monotonic() > deadline:
                raise CheckpointError(f"ranks {sorted(waiting)} did not finish writing {tmp.name} within "
                                      f"{self.wait_for_ranks_s:.0f}s; it was not published")
            if waiting:
                time.sleep(0.05)
        shutil.rmtree(tmp / WRITTEN, ignore_errors=True)
        return entries
