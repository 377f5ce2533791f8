"""Nodes on a real network: each node a host of its own (a network namespace, tests/netns.py) with
its own loopback and one cable to a switch, its `deepspeed --hostfile H --no_ssh --node_rank K`
launcher started inside it and the master address node 0's own address. Nothing is set by hand
(no GLOO_SOCKET_IFNAME): the launch chooses the interface that reaches the master on each node
(ds_trhash.network).

``start_on_hosts`` is how every launch between hosts starts. That two hosts train what one host
with two processes trains, step by step, is shown by the launches of
tests/training/test_real_network_faults.py (each fault's run and its resume, both hosts up, to
the end); here, a master no host reaches, and a slowed, lossy link where the kernel has netem.

The local embedded corpus (the default config): the Hub stand-in listens on the test machine's
loopback, which a host here does not reach.
"""
import subprocess
from pathlib import Path

import pytest

from tests.netns import Hosts, hosts_or_skip, netem_missing
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


def _args(out: Path, *extra: str) -> list[str]:
    """The session's 2-process reference run (12 steps, micro_batch 4, ZeRO 1, a checkpoint every
    3 steps, every step logged), which test_multinode.py shares."""
    return L.reference_run(out, micro=4, extra=extra)


@pytest.fixture(scope="module")
def hosts():
    with hosts_or_skip(2) as made:
        yield made


def start_on_hosts(hosts: Hosts, args: list[str], workdir: Path, master: str | None = None) -> list[subprocess.Popen]:
    """One launcher per host, each in a session of its own (as from a terminal per node): node K
    on host K, master ``master`` (default node 0's address); the environment without GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME, so the launch's own choice is what is tested."""
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"node{k} slots=1\n" for k in range(hosts.count)))
    env = L.base_env()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    port = str(L.free_port())
    procs = []
    for k in range(hosts.count):
        cmd = [str(L.VENV_BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k),
               "--master_addr", master or hosts.address(0), "--master_port", port, str(L.REPO / "launch" / "train.py"), *args]
        procs.append(subprocess.Popen(hosts.command(k, cmd), cwd=L.REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Every launcher waited for (at most ``timeout`` s each); whatever is left of one is killed."""
    try:
        said = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, said)]
    finally:
        for p in procs:
            if p.poll() is None or L.group_processes(p.pid):
                L.kill_group(p)


def test_a_master_no_interface_reaches_is_refused_on_every_node_writing_nothing(hosts, tmp_path):
    """The master address is on no host's network (a typo, a wrong --master_addr): every rank
    refuses before the process group starts, naming MASTER_ADDR, what it tried and the fix, and
    the output directory is left as it was (here: absent)."""
    lost = "198.19.254.1"
    out = tmp_path / "run"
    nodes = finish(start_on_hosts(hosts, _args(out), tmp_path, master=lost), timeout=300)
    for rank, proc in enumerate(nodes):
        assert proc.returncode == 2, L.explain(proc)
        assert (f"error: rank {rank}: no network interface of this host reaches the master MASTER_ADDR={lost}: "
                f"tried {lost}: no route (Network is unreachable) (interfaces here: {hosts.device(rank)}, lo); "
                f"check the route to it (`ip route get {lost}`) and the master address (deepspeed --master_addr), "
                "or set GLOO_SOCKET_IFNAME to the interface that reaches it") in proc.stderr, L.explain(proc)
        assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def test_a_slowed_lossy_link_trains_the_same_without_a_false_alarm(shared_launches, tmp_path):
    """Both cables 20 ms slow each way and losing 1 % of the packets (TCP resends them): the run
    ends, every step's loss the one-host run's, and no rank is taken for lost."""
    why = netem_missing()
    if why:
        pytest.skip(why)
    reference = shared_launches.get(2, _args)
    with Hosts(2) as slowed:  # hosts of its own: the module's keep their plain cables
        for k in range(slowed.count):
            slowed.slow(k, "delay", "20ms", "loss", "1%")
        nodes = finish(start_on_hosts(slowed, _args(tmp_path / "slow"), tmp_path), timeout=900)
    for proc in nodes:
        assert proc.returncode == 0, L.explain(proc)
        assert "lost rank" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr, L.explain(proc)
    assert L.train_losses(tmp_path / "slow") == L.train_losses(reference)
    assert not (tmp_path / "slow" / "lost_peer.json").exists()
