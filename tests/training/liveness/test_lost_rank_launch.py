"""Lost ranks on real launches: two `deepspeed --no_ssh --node_rank K` launchers on loopback (one
rank each), the session's shared 12-step reference arguments, and one fault per launch, the
four launches running side by side (their waits overlap):

- node 1 killed with kill -9 (runner, launch.py and rank);
- node 0 killed with kill -9 (the node of the rendezvous store);
- rank 1 frozen with SIGSTOP, and continued with SIGCONT once the other node has gone;
- rank 1's training thread stuck after step 5 (``hang_after_step``) with a 15 s stuck limit.

With the default liveness settings every surviving rank, its launch.py and its runner print the
one line naming the lost rank and are gone (exit 76) within 60 s of the fault; the stuck rank is
named with its phase within its limit + 30 s. The last complete checkpoint verifies, nothing
half-written was published, and the same command with --resume auto continues bit-identically
to the uninterrupted reference (after the node-0 kill and after the freeze).
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from ds_trhash.checkpoints import list_checkpoints, verify
from ds_trhash.training.liveness import LOST_PEER_FILE
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

AT_STEP = 5  # the fault lands once this many steps are logged (checkpoints every 3 steps: step 3 is complete)
GONE_S = 60.0
STUCK_S = 15.0


def _args(out: Path, *extra: str) -> list[str]:
    return L.reference_run(out, micro=4, extra=extra)


class Launch:
    """One two-node launch, its output read as it comes (pipes never fill), each launcher's exit time."""

    def __init__(self, root: Path, name: str, *extra: str, **env: str):
        self.dir = root / name
        self.dir.mkdir()
        self.out = self.dir / "out"
        self.procs, self.port = L.start_two_nodes(_args(self.out, *extra), self.dir, new_sessions=True, **env)
        self.said: dict[int, str] = {}
        self.ended: dict[int, float] = {}
        self.readers = [threading.Thread(target=self._read, args=(n,), daemon=True) for n in (0, 1)]
        for reader in self.readers:
            reader.start()
        self.fault_at: float | None = None

    def _read(self, node: int) -> None:
        out, err = self.procs[node].communicate()
        self.said[node] = out + err
        self.ended[node] = time.monotonic()

    def steps(self) -> int:
        return len(L.metrics(self.out)) if (self.out / "metrics.csv").exists() else 0

    def rank_process(self, node: int) -> psutil.Process:
        """The training process under node ``node``'s launch.py."""
        for child in psutil.Process(self.procs[node].pid).children(recursive=True):
            if "--local_rank=0" in child.cmdline():
                return child
        raise AssertionError(f"no rank under node {node}'s launcher")

    def wait(self, nodes=(0, 1), timeout: float = 240.0) -> None:
        for node in nodes:
            self.readers[node].join(timeout)
            assert not self.readers[node].is_alive(), f"node {node} still runs {timeout:.0f} s on"

    def gone_after(self, node: int) -> float:
        return self.ended[node] - self.fault_at

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None or L.group_processes(proc.pid):
                L.kill_group(proc)
        for seg in L.shm_segments(self.port):
            seg.unlink(missing_ok=True)


def _fault_when_ready(launches: dict[str, Launch], faults: dict, deadline_s: float = 400.0) -> None:
    """Each launch's fault, once it has logged ``AT_STEP`` steps (or, for the hang, the fault's step)."""
    pending = dict(faults)
    deadline = time.monotonic() + deadline_s
    while pending:
        for name, fault in list(pending.items()):
            launch = launches[name]
            assert not launch.ended, f"{name}: a node ended before its fault:\n" + "\n".join(launch.said.values())[-4000:]
            if launch.steps() >= AT_STEP:
                fault(launch)
                launch.fault_at = time.monotonic()
                del pending[name]
        assert time.monotonic() < deadline, f"never reached step {AT_STEP}: {sorted(pending)}"
        time.sleep(0.05)


def _kill_node(node: int):
    return lambda launch: os.killpg(launch.procs[node].pid, signal.SIGKILL)


def _freeze(launch: Launch) -> None:
    launch.frozen = launch.rank_process(1)
    launch.frozen.suspend()


@pytest.fixture(scope="module")
def faults(tmp_path_factory, shared_launches):
    """The four faulted launches (run side by side), their resumes, and the shared reference."""
    root = tmp_path_factory.mktemp("lost-rank")
    reference = shared_launches.get(2, _args)
    launches = {
        "kill-node1": Launch(root, "kill-node1"),
        "kill-node0": Launch(root, "kill-node0"),
        "freeze": Launch(root, "freeze"),
        "hang": Launch(root, "hang", "--set", f"liveness.stuck_minutes={STUCK_S / 60}",
                       DS_TRHASH_FAULT=f"hang_after_step:{AT_STEP}:1"),
    }
    try:
        _fault_when_ready(launches, {"kill-node1": _kill_node(1), "kill-node0": _kill_node(0), "freeze": _freeze,
                                     "hang": lambda launch: None})  # the hang is the run's own, after step 5
        for name, node in (("kill-node1", 0), ("kill-node0", 1), ("freeze", 0)):
            launches[name].wait((node,))
        launches["hang"].wait()
        freeze = launches["freeze"]
        freeze.published = sorted(p.name for p in (freeze.out / "checkpoints").iterdir())
        freeze.resumed_at = time.monotonic()
        freeze.frozen.resume()  # SIGCONT: it must not go on alone
        freeze.wait((1,), timeout=120)
        for launch in launches.values():  # what the faults left, before any resume
            launch.checkpoints = sorted(p.name for p in (launch.out / "checkpoints").iterdir())
            launch.complete = [(c.path.name, verify(c.path, deep=True)[0]) for c in list_checkpoints(launch.out)]
            launch.record = json.loads((launch.out / LOST_PEER_FILE).read_text())
        resumes = {name: Launch(root, f"{name}-resume", "--output-dir", str(launches[name].out), "--resume", "auto")
                   for name in ("kill-node0", "freeze")}
        for resume in resumes.values():
            resume.wait()
        yield launches, resumes, reference
    finally:
        for launch in launches.values():
            launch.cleanup()


LOST = r"error: rank {me}/2: lost rank {lost} \(node {lost}, host [^)]+\): silent for (\d+) s, last heard at step (\d+)"


def _survivor_said_and_left(launch: Launch, node: int, lost: int) -> None:
    said = launch.said[node]
    match = re.search(LOST.format(me=node, lost=lost), said)
    assert match, said[-5000:]
    # the step of its last heartbeat (up to a second before the fault: a tiny step takes a fraction of one)
    assert 30 <= int(match.group(1)) < GONE_S and 0 < int(match.group(2)) <= L.REFERENCE_STEPS
    assert "exits with return code = 76" in said, said[-3000:]  # launch.py passed the rank's code on
    assert launch.procs[node].returncode == 76  # and so did the runner
    assert launch.gone_after(node) < GONE_S, launch.gone_after(node)
    assert not L.group_processes(launch.procs[node].pid)
    assert "lost contact with another rank" not in said and "Traceback" not in said


def _checkpoints_intact(launch: Launch) -> None:
    """After the fault: at least one complete checkpoint, each verifying, and every published
    folder one of them (a save in flight left at most a ``.tmp``)."""
    assert launch.complete and all(ok for _, ok in launch.complete), launch.complete
    assert [n for n in launch.checkpoints if not n.endswith(".tmp")] == [name for name, _ in launch.complete]


def test_node_1_killed_is_named_by_node_0_which_exits_76_within_a_minute(faults):
    launches, _, _ = faults
    launch = launches["kill-node1"]
    _survivor_said_and_left(launch, 0, lost=1)
    assert {k: launch.record[k] for k in ("rank", "node", "reason", "detected_by_rank", "code")} == {
        "rank": 1, "node": 1, "reason": "silent", "detected_by_rank": 0, "code": 76}
    assert launch.record["host"] and launch.record["step"] > 0 and launch.record["silent_s"] >= 30
    _checkpoints_intact(launch)


def test_node_0_killed_with_the_store_is_named_by_node_1(faults):
    launches, _, _ = faults
    launch = launches["kill-node0"]
    _survivor_said_and_left(launch, 1, lost=0)
    assert (launch.record["rank"], launch.record["detected_by_rank"]) == (0, 1)
    _checkpoints_intact(launch)


def test_a_frozen_rank_is_named_and_exits_76_without_publishing_when_continued(faults):
    launches, _, _ = faults
    launch = launches["freeze"]
    _survivor_said_and_left(launch, 0, lost=1)
    said = launch.said[1]
    assert re.search(r"error: rank 1/2: this rank, rank 1 \(node 1, host [^)]+\), was frozen or cut off for \d+ s "
                     r"at step \d+ \(\w+\): the other ranks have given up on it; exiting 76 without waiting, "
                     r"publishing no checkpoint", said), said[-4000:]
    assert launch.procs[1].returncode == 76 and launch.ended[1] - launch.resumed_at < GONE_S
    assert launch.checkpoints == launch.published  # nothing published after it came back
    assert launch.record["rank"] == 1 and launch.record["detected_by_rank"] == 0  # the first verdict is kept
    _checkpoints_intact(launch)


def test_a_rank_stuck_while_alive_is_named_with_its_phase_by_every_rank(faults):
    launches, _, _ = faults
    launch = launches["hang"]
    for node in (0, 1):
        said = launch.said[node]
        match = re.search(rf"error: rank {node}/2: rank 1 \(node 1, host [^)]+\) is stuck in step_end at step "
                          rf"{AT_STEP} for (\d+) s \(limit 15 s\)", said)
        assert match, said[-4000:]
        assert launch.procs[node].returncode == 76
        assert launch.ended[node] - launch.fault_at < STUCK_S + 30 + 5  # the fault's step logged -> gone
    assert (launch.record["rank"], launch.record["phase"], launch.record["reason"]) == (1, "step_end", "stuck")
    _checkpoints_intact(launch)


@pytest.mark.parametrize("name", ["kill-node0", "freeze"])
def test_resume_auto_continues_bit_identically(faults, name):
    launches, resumes, reference = faults
    resume = resumes[name]
    for node in (0, 1):
        assert resume.procs[node].returncode == 0, resume.said[node][-4000:]
    assert "resuming at step" in resume.said[0]
    assert L.train_losses(launches[name].out) == L.train_losses(reference)
    assert [c.step for c in list_checkpoints(launches[name].out)][-1] == L.REFERENCE_STEPS
