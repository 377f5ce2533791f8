"""``ds-trhash sync --watch RUN_DIR``: back a training run up to the Hub while it trains.

Every ``every`` seconds the watcher runs one pass of the one-shot sync (``release.hub.sync.sync``:
complete checkpoints and exports only, one commit per unit, every remote hash checked, each
verified unit recorded in ``sync_verified.json``) as a child process; a pass leaves alone what
earlier passes recorded with its current manifest (``--incremental``), so a long run is not
hashed again every interval. A pass that runs longer
than ``pass_timeout`` (a stalled connection can leave the client waiting far longer than any
socket timeout suggests) is killed with its whole process group, logged, and retried at the next
interval. Killing a pass never damages what earlier passes verified: a Hub commit is all or
nothing, ``sync_verified.json`` is replaced atomically, and a unit is recorded only after its
remote hashes matched. The pass holds the output directory's sync lock, which the trainer's
rotation and ``ds-trhash cleanup`` take too, so uploads never race deletion. The child dies with
the watcher (``PR_SET_PDEATHSIG``), so a ``kill -9`` of the watcher leaves no orphan upload.

The run has finished when its completion record (``stage_complete.json``) exists and no launch
holds its run lock; the watcher exits 0 once, after that, every complete checkpoint still on
disk and ``final/`` are recorded as verified on this repository under this prefix. It then runs
the run's ``training.cleanup_after_success`` (from its ``config.json``), whose own conditions
still apply. A run that is still training, or that crashed and will be resumed, keeps it waiting.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_trhash import hub_access
from ds_trhash.checkpoints import CHECKPOINTS, MANIFEST, list_checkpoints
from ds_trhash.checkpoints.run_lock import RUN_LOCK, is_alive
from ds_trhash.checkpoints.sync_guard import read_verified
from ds_trhash.release.export.manifest import EXPORT_MANIFEST
from ds_trhash.release.hub import client as hub_client
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub.sync import SyncError
from ds_trhash.release.lifecycle.cleanup import CleanupRefused, cleanup
from ds_trhash.release.lifecycle.final import COMPLETE_FILE, FINAL_DIR, read_completion

if TYPE_CHECKING:
    from huggingface_hub import HfApi

Log = Callable[[str], None]
RUN_MARKERS = ("config.json", CHECKPOINTS, RUN_LOCK, COMPLETE_FILE, FINAL_DIR)
_PR_SET_PDEATHSIG = 1


_PRCTL: Callable[..., int] | None
try:  # looked up once here: between fork and exec the child only calls it (no loading, no allocation)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None  # not Linux: a pass then outlives a killed watcher, and the sync lock keeps it safe


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def check_args(run_dir: str | os.PathLike, repo_id: str, prefix: str, every: float, pass_timeout: float) -> str:
    """Refusals that need no network; returns the normalised prefix."""
    problem = hub_access.repo_id_problem(repo_id)
    if problem:
        raise SyncError(f"--repo {repo_id!r} is not a Hub repository id: {problem}")
    for name, value in (("--every", every), ("--pass-timeout", pass_timeout)):
        if not value > 0 or value == float("inf"):
            raise SyncError(f"{name} must be a positive number of seconds, got {value}")
    out = Path(run_dir)
    if out.exists() and not out.is_dir():
        raise SyncError(f"{out} is a file, not a run output directory; pass the training launch's --output-dir")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in RUN_MARKERS):
        raise SyncError(f"{out} is not a run output directory (none of {', '.join(RUN_MARKERS)}); pass the "
                        "training launch's --output-dir")
    return hub.check_prefix(prefix)


def check_repo(api: HfApi, repo_id: str, repo_type: str | None, revision: str | None, create: bool) -> str | None:
    """The repository must exist (or be created with ``create``): a typo in --repo is refused
    before the run is waited for, instead of creating a stray repository. A Hub that does not
    answer is not a refusal (the passes retry): the warning is returned."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        api.repo_info(repo_id, repo_type=repo_type, revision=revision or "main")
        return None
    except RepositoryNotFoundError:
        if not create:
            raise SyncError(f"repository {repo_id} does not exist on the Hub (or the token cannot see it): create it, "
                            "or pass --create-repo to create it private") from None
    except Exception as exc:  # network: the passes retry; only an unknown repository is final
        return f"cannot reach the Hub to look up {repo_id} ({type(exc).__name__}: {exc}); the passes retry"
    hub_client.call_hub(f"creating {repo_id}", api.create_repo, repo_id, repo_type=repo_type, private=True,
                        exist_ok=True)
    return None


def unverified(run_dir: Path, repo_id: str, prefix: str) -> list[str]:
    """The units that must still reach the Hub before the watcher may exit: complete
    checkpoints on disk and ``final/``, each not yet recorded with its current manifest."""
    records = read_verified(run_dir)

    def done(name: str, manifest: Path) -> bool:
        return hub.recorded_as_verified(records, name, manifest, repo_id, prefix)

    missing = [f"{CHECKPOINTS}/{c.name}" for c in list_checkpoints(run_dir)
               if c.has_manifest and not done(f"{CHECKPOINTS}/{c.name}", c.path / MANIFEST)]
    if (run_dir / FINAL_DIR).is_dir() and not done(FINAL_DIR, run_dir / FINAL_DIR / EXPORT_MANIFEST):
        missing.append(FINAL_DIR)
    return missing


def finished(run_dir: Path) -> str | None:
    """Why the run is not finished yet, or None when it is."""
    if read_completion(run_dir) is None:
        return "the stage has not completed"
    holder = is_alive(run_dir)
    if holder is not None:
        return f"its launch (pid {holder.get('pid')}) is still running"
    return None


def _has_units(run_dir: Path) -> bool:
    return any(c.has_manifest for c in list_checkpoints(run_dir)) or (run_dir / FINAL_DIR).is_dir()


def _cleanup_mode(run_dir: Path) -> str:
    try:
        cfg = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        return str((cfg.get("training") or {}).get("cleanup_after_success") or "off")
    except (OSError, ValueError, AttributeError):
        return "off"


class Watcher:
    def __init__(self, run_dir: str | os.PathLike, repo_id: str, *, prefix: str = "", every: float = 60.0,
                 pass_timeout: float = 3600.0, repo_type: str | None = None, revision: str | None = None,
                 lock_timeout: float = 30.0, log: Log = print):
        self.run_dir, self.repo_id, self.prefix = Path(run_dir), repo_id, prefix
        self.every, self.pass_timeout, self.lock_timeout = every, pass_timeout, lock_timeout
        self.repo_type, self.revision = repo_type, revision
        self.say: Log = lambda line: log(hub.redact(f"watch {self.run_dir}: {line}"))  # noqa: E731
        self.passes = 0

    def pass_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "ds_trhash.cli", "sync", "--local", str(self.run_dir), "--repo-id",
               self.repo_id, "--lock-timeout", str(self.lock_timeout), "--incremental"]
        if self.prefix:
            cmd += ["--path-in-repo", self.prefix]
        if self.repo_type:
            cmd += ["--repo-type", self.repo_type]
        if self.revision:
            cmd += ["--revision", self.revision]
        return cmd

    def one_pass(self) -> bool:
        """One sync pass in a child process; False when it failed or stalled (and was killed)."""
        self.passes += 1
        started = time.monotonic()
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # a log, not a terminal: no progress bars
        proc = subprocess.Popen(self.pass_command(), env=env, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            code = proc.wait(timeout=self.pass_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self.say(f"pass {self.passes} stalled: no result after {self.pass_timeout:g}s; killed it (what earlier "
                     f"passes verified stays verified), retrying in {self.every:g}s")
            return False
        if code != 0:
            self.say(f"pass {self.passes} failed (exit {code}, its message above); retrying in {self.every:g}s")
            return False
        self.say(f"pass {self.passes} complete in {time.monotonic() - started:.1f}s")
        return True

    def run(self, max_passes: int | None = None) -> int:
        rounds = 0
        while True:
            rounds += 1
            why_not = finished(self.run_dir)  # read before the pass: what the pass sees is then final
            ok = False
            if _has_units(self.run_dir):
                ok = self.one_pass()
            else:
                self.say("no complete checkpoint yet; waiting")
            if ok and why_not is None:
                missing = unverified(self.run_dir, self.repo_id, self.prefix)
                if not missing:
                    self.say(f"the run has finished and every checkpoint and {FINAL_DIR}/ is verified on "
                             f"{self.repo_id}; done")
                    self.after_success()
                    return 0
                self.say(f"the run has finished; still to verify: {', '.join(missing)}")
            if max_passes is not None and rounds >= max_passes:  # tests: a bounded watch
                return 1
            time.sleep(self.every)

    def after_success(self) -> None:
        mode = _cleanup_mode(self.run_dir)
        if mode == "off":
            return
        try:
            report = cleanup(self.run_dir, mode, lock_timeout=self.lock_timeout, log=self.say)
            self.say(f"cleanup after success ({mode}): removed {len(report.removed)} checkpoint(s)")
        except CleanupRefused as exc:
            self.say(f"cleanup after success not done: {exc}")


def watch(run_dir: str | os.PathLike, repo_id: str, *, prefix: str = "", every: float = 60.0,
          pass_timeout: float = 3600.0, repo_type: str | None = None, revision: str | None = None,
          create_repo: bool = False, log: Log = print, max_passes: int | None = None) -> int:
    """Check the arguments, the token and the repository, then watch until the run is backed up."""
    prefix = check_args(run_dir, repo_id, prefix, every, pass_timeout)
    api = hub.make_api(require_token=True)
    warning = check_repo(api, repo_id, repo_type, revision, create_repo)
    watcher = Watcher(run_dir, repo_id, prefix=prefix, every=every, pass_timeout=pass_timeout, repo_type=repo_type,
                      revision=revision, log=log)
    if warning:
        watcher.say(f"warning: {warning}")
    return watcher.run(max_passes)
