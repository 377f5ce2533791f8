"""A node lost on a real network, each node a host of its own (tests/netns.py): node 1's cable
cut (its link set down, as when a cable or a switch dies), node 1's processes killed (kill -9),
node 0's processes killed (kill -9, the rendezvous store with them). The three launches run side
by side, each on its own pair of hosts (their waits overlap). Every surviving rank prints the
liveness line naming the lost rank (its node, host, silence and the step it was last heard at),
launch.py and the runner pass its exit 76 (EXIT_PEER_LOST) on, and every process of the node is
gone within 60 s of the fault; then, the cable plugged back in, the same command with
``--resume auto`` on both hosts continues from the last complete checkpoint, every step's loss
the uninterrupted run's. These runs are also the suite's two hosts training with nothing set by
hand (no GLOO_SOCKET_IFNAME): every node chooses the interface that reaches the master itself and
says which, and the steps before each fault and after its resume are the one-host run's.
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

AT_STEP = 5  # the fault lands once this many steps are logged (checkpoints every 3 steps: step 3 is complete)
GONE_S = 60.0  # the bound: the fault to the last process of a surviving node gone
LOST = r"error: rank {me}/2: lost rank {lost} \(node {lost}, host [^)]+\): silent for (\d+) s, last heard at step (\d+)"


class HostLaunch(L.WatchedLaunch):
    """A launch on two hosts (``start_on_hosts``), watched."""

    def __init__(self, hosts: Hosts, out: Path, workdir: Path, *extra: str):
        self.hosts = hosts
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(start_on_hosts(hosts, [*_args(out), *extra], workdir), out)


def _kill(node: int):
    return lambda launch: os.killpg(launch.procs[node].pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def faults(tmp_path_factory, shared_launches):
    """The three faulted launches side by side, what each left (its ``lost_peer.json``), their
    resumes (side by side too), and the shared reference."""
    root = tmp_path_factory.mktemp("real-network-faults")
    reference = shared_launches.get(2, _args)
    with hosts_or_skip(2) as cut, Hosts(2) as one, Hosts(2) as zero:
        launches = {name: HostLaunch(hosts, root / name / "out", root / name)
                    for name, hosts in (("cut", cut), ("kill-node1", one), ("kill-node0", zero))}
        resumes: dict[str, HostLaunch] = {}
        try:
            L.fault_when_ready(launches, {"cut": lambda launch: cut.cut(1), "kill-node1": _kill(1),
                                          "kill-node0": _kill(0)}, AT_STEP)
            for launch in launches.values():
                launch.wait(timeout=240)
            cut.mend(1)  # the cable back in
            records = {name: json.loads((launch.out / "lost_peer.json").read_text()) for name, launch in launches.items()}
            resumes = {name: HostLaunch(launch.hosts, launch.out, root / f"{name}-resume", "--resume", "auto")
                       for name, launch in launches.items()}
            for resume in resumes.values():
                resume.wait(timeout=600)
            yield launches, records, resumes, reference
        finally:
            for launch in [*launches.values(), *resumes.values()]:
                launch.cleanup()


def _survivor_named_it_and_left(launch: HostLaunch, node: int, lost: int) -> None:
    """Node ``node`` named rank ``lost`` (node ``lost``: one rank per node), its launch.py and
    runner passed exit 76 on, and nothing of it was left GONE_S after the fault."""
    said = launch.said[node]
    match = re.search(LOST.format(me=node, lost=lost), said)
    assert match, said[-5000:]
    # the step of its last heartbeat: heartbeats go once a second and a tiny step takes a fraction of
    # one, so the last one heard may name a step or two before the fault's (it landed after step 5)
    assert int(match.group(1)) < GONE_S and 0 < int(match.group(2)) <= L.REFERENCE_STEPS, match.group(0)
    assert "exits with return code = 76" in said, said[-3000:]  # launch.py passed the rank's code on
    assert launch.procs[node].returncode == EXIT_PEER_LOST  # and so did the runner
    assert launch.gone_after(node) < GONE_S, launch.gone_after(node)
    assert not L.group_processes(launch.procs[node].pid)
    assert "lost contact with another rank" not in said and "Traceback" not in said


def test_a_cut_cable_is_named_on_both_sides_which_exit_76_within_a_minute(faults):
    """Neither node hears the other: each names the other, and both are gone."""
    launches, records, _, _ = faults
    launch = launches["cut"]
    _survivor_named_it_and_left(launch, 0, lost=1)
    _survivor_named_it_and_left(launch, 1, lost=0)
    assert records["cut"]["rank"] in (0, 1) and records["cut"]["code"] == EXIT_PEER_LOST, records["cut"]


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_node_is_named_by_the_other_which_exits_76_within_a_minute(faults, killed):
    launches, records, _, _ = faults
    launch = launches[f"kill-node{killed}"]
    _survivor_named_it_and_left(launch, 1 - killed, lost=killed)
    record = records[f"kill-node{killed}"]
    assert (record["rank"], record["node"], record["detected_by_rank"], record["code"]) == (
        killed, killed, 1 - killed, EXIT_PEER_LOST), record
    assert 0 < record["step"] <= L.REFERENCE_STEPS, record  # its last heartbeat's step (above)


@pytest.mark.parametrize("name", ["cut", "kill-node1", "kill-node0"])
def test_resume_auto_continues_bit_identically(faults, name):
    launches, _, resumes, reference = faults
    resume = resumes[name]
    for node in (0, 1):
        assert resume.procs[node].returncode == 0, resume.said[node][-4000:]
    assert "resuming at step" in resume.said[0], resume.said[0][-3000:]
    assert L.train_losses(launches[name].out) == L.train_losses(reference)
    final = f"step_{L.REFERENCE_STEPS:08d}"
    L.assert_identical(L.model_weights(launches[name].out / "checkpoints" / final),
                       L.model_weights(reference / "checkpoints" / final))


@pytest.mark.parametrize("name", ["cut", "kill-node1", "kill-node0"])
def test_two_hosts_choose_their_interface_with_nothing_set_by_hand(faults, name):
    """Each resume (both hosts up, trained to the end; its losses above): rank 0's start-up
    summary names the interface holding the master address, rank 1 the route to it."""
    launches, _, resumes, _ = faults
    hosts, said = launches[name].hosts, resumes[name].said
    assert f"network    gloo over {hosts.device(0)} ({hosts.address(0)}: holds the master address)" in said[0], \
        said[0][-4000:]
    assert (f"rank 1: gloo over {hosts.device(1)} ({hosts.address(1)}: the route to the master {hosts.address(0)})"
            in said[1]), said[1][-4000:]
