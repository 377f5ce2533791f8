"""Lost ranks on real launches: two `deepspeed --no_ssh --node_rank K` launchers on loopback (one
rank each), the session's shared 12-step reference arguments, and one run that meets two faults
in turn:

- rank 1 frozen with SIGSTOP, and continued with SIGCONT once the other node has gone;
- then, in the same command with --resume auto, rank 1's training thread stuck two steps after
  the checkpoint it continues from (``hang_after_step``), with a 15 s stuck limit;

and a last --resume auto that ends the run. With the default liveness settings every surviving
rank, its launch.py and its runner print the one line naming the lost rank and are gone (exit 76)
within 60 s of the fault; the stuck rank is named with its phase within its limit + 30 s. The last
complete checkpoint verifies, nothing half-written was published, and the launch after each fault
continues bit-identically to the uninterrupted reference, every step it trains.

A node killed with kill -9 (node 0, the node of the rendezvous store, and node 1) and a cable cut
are tested between real hosts, each node in its own network namespace, with their resumes
(tests/training/test_real_network_faults.py): the same launches on loopback would only repeat them.
"""
from __future__ import annotations

import json
import re
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


class Launch(L.WatchedLaunch):
    """One two-node launch on loopback (``L.start_two_nodes``, each node in a session of its own),
    watched; ``resumed_at``: the step it continues from (0: fresh)."""

    def __init__(self, root: Path, name: str, out: Path, *extra: str, **env: str):
        self.dir, self.resumed_at = root / name, L.resume_point(out)
        self.dir.mkdir()
        procs, port = L.start_two_nodes(_args(out, *extra), self.dir, new_sessions=True, **env)
        super().__init__(procs, out, port)

    def rank_process(self, node: int) -> psutil.Process:
        """The training process under node ``node``'s launch.py."""
        for child in psutil.Process(self.procs[node].pid).children(recursive=True):
            if "--local_rank=0" in child.cmdline():
                return child
        raise AssertionError(f"no rank under node {node}'s launcher")

    def note_what_it_left(self) -> None:
        """Before the next launch: the checkpoints, each verified, the record, the losses."""
        self.checkpoints = sorted(p.name for p in (self.out / "checkpoints").iterdir())
        self.complete = [(c.path.name, verify(c.path, deep=True)[0]) for c in list_checkpoints(self.out)]
        self.record = json.loads((self.out / LOST_PEER_FILE).read_text())
        self.losses = L.whole_losses(self.out)


def _freeze(launch: Launch) -> None:
    launch.frozen = launch.rank_process(1)
    launch.frozen.suspend()


@pytest.fixture(scope="module")
def faults(tmp_path_factory, shared_launches):
    """The freeze, the hang and the last launch, in turn in one output directory, and the shared
    reference."""
    root = tmp_path_factory.mktemp("lost-rank")
    reference = shared_launches.get(2, _args)
    out = root / "run"
    launches: dict[str, Launch] = {}
    try:
        freeze = launches["freeze"] = Launch(root, "freeze", out)
        L.fault_when_trained(freeze, _freeze, AT_STEP, None)
        freeze.wait((0,))
        freeze.published = sorted(p.name for p in (out / "checkpoints").iterdir())
        freeze.continued_at = time.monotonic()
        freeze.frozen.resume()  # SIGCONT: it must not go on alone
        freeze.wait((1,), timeout=120)
        freeze.note_what_it_left()
        stale, hang_at = L.metrics_inode(out), L.resume_point(out) + 2  # the hang is the run's own
        hang = launches["hang"] = Launch(root, "hang", out, "--resume", "auto", "--set",
                                         f"liveness.stuck_minutes={STUCK_S / 60}",
                                         DS_TRHASH_FAULT=f"hang_after_step:{hang_at}:1")
        hang.hang_at = hang_at
        L.fault_when_trained(hang, lambda launch: None, hang_at, stale)
        hang.wait()
        hang.note_what_it_left()
        end = launches["end"] = Launch(root, "end", out, "--resume", "auto")
        end.wait()
        end.losses = L.whole_losses(out)
        yield launches, reference
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


def test_a_frozen_rank_is_named_and_exits_76_without_publishing_when_continued(faults):
    launches, _ = faults
    launch = launches["freeze"]
    _survivor_said_and_left(launch, 0, lost=1)
    said = launch.said[1]
    assert re.search(r"error: rank 1/2: this rank, rank 1 \(node 1, host [^)]+\), was frozen or cut off for \d+ s "
                     r"at step \d+ \(\w+\): the other ranks have given up on it; exiting 76 without waiting, "
                     r"publishing no checkpoint", said), said[-4000:]
    assert launch.procs[1].returncode == 76 and launch.ended[1] - launch.continued_at < GONE_S
    assert launch.checkpoints == launch.published  # nothing published after it came back
    assert launch.record["rank"] == 1 and launch.record["detected_by_rank"] == 0  # the first verdict is kept
    _checkpoints_intact(launch)


def test_a_rank_stuck_while_alive_is_named_with_its_phase_by_every_rank(faults):
    launches, _ = faults
    launch = launches["hang"]
    for node in (0, 1):
        said = launch.said[node]
        match = re.search(rf"error: rank {node}/2: rank 1 \(node 1, host [^)]+\) is stuck in step_end at step "
                          rf"{launch.hang_at} for (\d+) s \(limit 15 s\)", said)
        assert match, said[-4000:]
        assert launch.procs[node].returncode == 76
        assert launch.ended[node] - launch.fault_at < STUCK_S + 30 + 5  # the fault's step logged -> gone
    assert (launch.record["rank"], launch.record["phase"], launch.record["reason"]) == (1, "step_end", "stuck")
    _checkpoints_intact(launch)


@pytest.mark.parametrize("name, after", [("freeze", "hang"), ("hang", "end")])
def test_resume_auto_continues_bit_identically(faults, name, after):
    """The launch after the fault continues from the last complete checkpoint the fault left, and
    every step it trains has the uninterrupted run's loss; the last one ends the run on the
    uninterrupted run's weights."""
    launches, reference = faults
    L.assert_continues(launches[after], reference, last=after == "end")
