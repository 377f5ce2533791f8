"""A node lost on a real network, each node a host of its own (tests/netns.py): node 1's processes
killed (kill -9), node 0's processes killed (kill -9, the rendezvous store with them), node 1's
cable cut (its link set down, as when a cable or a switch dies).

One run on one pair of hosts meets the three faults in turn: the first launch is fresh, and each
later one is the same command with ``--resume auto``, which continues from the last complete
checkpoint that the fault before it left, until its own fault lands two steps on; a last resume,
the cable plugged back in, ends the run. So each fault's run is continued by the next launch,
and every step that launch trains is compared with the uninterrupted run's, bit for bit; the last
one's weights too. Every surviving rank prints the liveness line naming the lost rank (its node,
host, silence and the step it was last heard at), launch.py and the runner pass its exit 76
(EXIT_PEER_LOST) on, and every process of the node is gone within 60 s of the fault.

These launches are also the suite's two hosts training with nothing set by hand (no
GLOO_SOCKET_IFNAME): every node chooses the interface that reaches the master itself and says
which, and the steps each trains are the one-host run's.
"""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from ds_trhash.training.signals import EXIT_PEER_LOST
from tests.netns import Hosts, hosts_or_skip
from tests.training import launch_utils as L
from tests.training.test_real_network import _args, start_on_hosts

pytestmark = pytest.mark.e2e

AT_STEP = 5  # a fresh run's fault lands once this many steps are logged (checkpoints every 3: step 3 is complete)
GONE_S = 60.0  # the bound: the fault to the last process of a surviving node gone
LOST = r"error: rank {me}/2: lost rank {lost} \(node {lost}, host [^)]+\): silent for (\d+) s, last heard at step (\d+)"


class HostLaunch(L.WatchedLaunch):
    """A launch on two hosts (``start_on_hosts``), watched; ``resumed_at``: the step it continues
    from (0: fresh); ``losses``: the training losses of the run when it ended."""

    def __init__(self, hosts: Hosts, out: Path, workdir: Path, *extra: str):
        self.hosts, self.resumed_at = hosts, L.resume_point(out)
        self.losses: list[float] = []
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(start_on_hosts(hosts, [*_args(out), *extra], workdir), out)


def _kill(node: int):
    return lambda launch: os.killpg(launch.procs[node].pid, signal.SIGKILL)


FAULTS = {"kill-node1": _kill(1), "kill-node0": _kill(0), "cut": lambda launch: launch.hosts.cut(1)}


@pytest.fixture(scope="module")
def faults(tmp_path_factory, shared_launches):
    """The faulted launches in turn (by fault), the launch after each (by the fault it continues
    from), what each fault left (its ``lost_peer.json``), and the shared reference."""
    root = tmp_path_factory.mktemp("real-network-faults")
    reference = shared_launches.get(2, _args)
    out = root / "run"
    launches: dict[str, HostLaunch] = {}
    records: dict[str, dict] = {}
    with hosts_or_skip(2) as hosts:
        try:
            for name, fault in FAULTS.items():
                stale = L.metrics_inode(out)
                launch = launches[name] = HostLaunch(hosts, out, root / name, *(["--resume", "auto"] if launches else []))
                L.fault_when_trained(launch, fault, max(AT_STEP, launch.resumed_at + 2), stale)
                launch.wait(timeout=240)
                hosts.mend(1)  # the cable back in (after the cut; up already otherwise)
                launch.losses = L.whole_losses(out)
                records[name] = json.loads((out / "lost_peer.json").read_text())
            last = launches["end"] = HostLaunch(hosts, out, root / "end", "--resume", "auto")
            last.wait(timeout=600)
            last.losses = L.whole_losses(out)
            names = list(launches)
            yield launches, {name: launches[after] for name, after in zip(names, names[1:])}, records, reference
        finally:
            for launch in launches.values():
                launch.cleanup()


def _heard_at(launch: HostLaunch, step: int) -> bool:
    """Whether ``step`` can be the step of the lost rank's last heartbeat. Heartbeats go once a
    second and a tiny step takes a fraction of one, so the last one heard may name a step or two
    before the fault's; a launch that resumed names the step it continues from once it has
    restored it, and 0 before (a heartbeat of its start-up)."""
    if launch.resumed_at:
        return step == 0 or launch.resumed_at <= step <= L.REFERENCE_STEPS
    return 0 < step <= L.REFERENCE_STEPS


def _survivor_named_it_and_left(launch: HostLaunch, node: int, lost: int) -> None:
    """Node ``node`` named rank ``lost`` (node ``lost``: one rank per node), its launch.py and
    runner passed exit 76 on, and nothing of it was left GONE_S after the fault."""
    said = launch.said[node]
    match = re.search(LOST.format(me=node, lost=lost), said)
    assert match, said[-5000:]
    assert int(match.group(1)) < GONE_S and _heard_at(launch, int(match.group(2))), match.group(0)
    assert "exits with return code = 76" in said, said[-3000:]  # launch.py passed the rank's code on
    assert launch.procs[node].returncode == EXIT_PEER_LOST  # and so did the runner
    assert launch.gone_after(node) < GONE_S, launch.gone_after(node)
    assert not L.group_processes(launch.procs[node].pid)
    assert "lost contact with another rank" not in said and "Traceback" not in said


def test_a_cut_cable_is_named_on_both_sides_which_exit_76_within_a_minute(faults):
    """Neither node hears the other: each names the other, and both are gone."""
    launches, _, records, _ = faults
    launch = launches["cut"]
    _survivor_named_it_and_left(launch, 0, lost=1)
    _survivor_named_it_and_left(launch, 1, lost=0)
    assert records["cut"]["rank"] in (0, 1) and records["cut"]["code"] == EXIT_PEER_LOST, records["cut"]


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_node_is_named_by_the_other_which_exits_76_within_a_minute(faults, killed):
    launches, _, records, _ = faults
    launch = launches[f"kill-node{killed}"]
    _survivor_named_it_and_left(launch, 1 - killed, lost=killed)
    record = records[f"kill-node{killed}"]
    assert (record["rank"], record["node"], record["detected_by_rank"], record["code"]) == (
        killed, killed, 1 - killed, EXIT_PEER_LOST), record
    assert _heard_at(launch, record["step"]), record


@pytest.mark.parametrize("name", list(FAULTS))
def test_resume_auto_continues_bit_identically(faults, name):
    """The launch after the fault continues from the last complete checkpoint the fault left, and
    every step it trains has the uninterrupted run's loss; the last launch ends the run with the
    uninterrupted run's weights."""
    launches, after, _, reference = faults
    L.assert_continues(after[name], reference, last=after[name] is launches["end"])


def test_two_hosts_choose_their_interface_with_nothing_set_by_hand(faults):
    """Every launch (the fresh one, each resume): rank 0's start-up summary names the interface
    holding the master address, rank 1 the route to it; the fresh launch's steps before its fault
    are the one-host run's."""
    launches, _, _, reference = faults
    for launch in launches.values():
        hosts, said = launch.hosts, launch.said
        assert f"network    gloo over {hosts.device(0)} ({hosts.address(0)}: holds the master address)" in said[0], \
            said[0][-4000:]
        assert (f"rank 1: gloo over {hosts.device(1)} ({hosts.address(1)}: the route to the master {hosts.address(0)})"
                in said[1]), said[1][-4000:]
    first = launches["kill-node1"].losses
    assert len(first) >= AT_STEP and first == L.train_losses(reference)[:len(first)]
