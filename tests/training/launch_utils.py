"""Run real training launches from tests: the `deepspeed` launcher or one plain process."""

from __future__ import annotations

import csv
import hashlib
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from filelock import FileLock

from ds_trhash.deepspeed_command import free_port  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def base_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RESUME", None)
    env.pop("TARGET_TOKENS", None)
    env.pop("DS_TRHASH_FAULT", None)
    env.update(extra)
    return env


def shm_segments(port: int) -> list[Path]:
    """DeepSpeed CPU shared-memory segments of a launch on this master port (none should outlive it)."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def deepspeed(nproc: int, args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N launch/train.py ...`: N CPU processes over gloo.

    Every launch is also a leak check: a DeepSpeed shared-memory segment left in /dev/shm is
    removed and reported as a failure (they are RAM, and never freed otherwise)."""
    port = free_port()
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port),
           str(REPO / "launch" / "train.py"), *args]
    try:
        return subprocess.run(cmd, cwd=REPO, env=base_env(**env), capture_output=True, text=True, timeout=timeout)
    finally:
        leftover = shm_segments(port)
        for p in leftover:
            p.unlink(missing_ok=True)
        assert not leftover, f"the launch left DeepSpeed shared-memory segments behind: {leftover}"


def start_two_nodes(args: list[str], workdir: Path, node_args=lambda node: [], new_sessions: bool = False,
                    slots: int | tuple[int, int] = 1, **env: str) -> tuple[list[subprocess.Popen], int]:
    """``two_nodes``' launchers, started and not waited for: (the launchers, the master port).
    ``new_sessions``: each in a session and process group of its own, as from a terminal per node;
    ``slots``: CPU processes per node (a pair: each node's)."""
    port = free_port()
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"node{node} slots={n}\n" for node, n in enumerate(
        slots if isinstance(slots, tuple) else (slots, slots))))
    procs = []
    for node in (0, 1):
        cmd = [str(VENV_BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
               "--master_addr", "127.0.0.1", "--master_port", str(port), str(REPO / "launch" / "train.py"), *args, *node_args(node)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=base_env(**env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=new_sessions))
    return procs, port


def two_nodes(args: list[str], workdir: Path, timeout: int = 300, node_args=lambda node: [],
              slots: int | tuple[int, int] = 1, **env: str) -> list[subprocess.CompletedProcess]:
    """A two-node launch simulated on this machine: one `deepspeed` launcher per "node", each with
    the same hostfile (two hosts, one slot each), `--no_ssh`, its `--node_rank`, and the same master
    address and port on loopback; one CPU process per node. ``node_args(node)`` adds what differs
    between nodes (e.g. each node's own ``data.cache_dir``); ``slots``: processes per node (1).
    Returns both launchers' results."""
    procs, port = start_two_nodes(args, workdir, node_args, slots=slots, **env)
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        leftover = shm_segments(port)
        for seg in leftover:
            seg.unlink(missing_ok=True)
    assert not leftover, f"the launch left DeepSpeed shared-memory segments behind: {leftover}"
    return results


def single(args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """One plain process (no launcher): RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* set by hand."""
    e = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(free_port()), **env)
    return subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=timeout)


class SharedLaunches:
    """Uninterrupted launches that several test modules compare against with the same arguments,
    run once per test session (the session fixture `shared_launches` in tests/conftest.py).

    Under `make test` each xdist worker has its own session fixtures, so the runs live in a
    folder every worker of the session shares, and each is made under a file lock: the first
    worker to ask launches it, the others wait and read its output. A run is keyed by its
    process count and its arguments (with the output folder left out); its ``.done`` file is
    written after it succeeded, so a launch cut short is redone, never read. The tests only
    read a run: they copy a checkpoint before changing anything."""

    def __init__(self, root: Path, launch=None):
        self.root = root
        self.launch = launch or (lambda nproc, args: single(args) if nproc == 1 else deepspeed(nproc, args))

    def get(self, nproc: int, args_for) -> Path:
        """The output folder of ``args_for(out)`` launched on ``nproc`` processes (1: one plain one)."""
        key = json.dumps([nproc, [str(a) for a in args_for(Path("<out>"))]])
        out = self.root / f"run-{nproc}p-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        done = out.with_name(out.name + ".done")
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)  # a launch cut short by an earlier failure
                proc = self.launch(nproc, args_for(out))
                assert proc.returncode == 0, explain(proc)
                done.write_text(key + "\n")
        return out


REFERENCE_STEPS = 12


def reference_run(out: Path, micro: int = 8, zero: int = 1, extra=()) -> list[str]:
    """The arguments of the 12-step tiny pretraining (a checkpoint every 3 steps, all kept, every
    step logged) that the exact-resume, reshard, expert-parallel, streaming and launch tests
    compare against or read. With micro_batch 8 // nproc every layout trains the same 8 rows a
    step; each (process count, ZeRO stage) is one shared launch (``SharedLaunches.get``)."""
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", str(REFERENCE_STEPS),
            "--set", "checkpoint.every_steps=3", "--set", "checkpoint.keep_last=10", "--set", "checkpoint.packs=null",
            "--set", "training.log_every=1", "--set", f"batch.micro_batch={micro}", "--set", f"zero.stage={zero}",
            *extra]


def tiny_pretraining(out: Path) -> list[str]:
    """The arguments of the 30-step tiny pretraining (every step logged) that the SFT stage tests
    start from and the loss-falls test reads: one shared launch (``SharedLaunches.get(1, ...)``)."""
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "30",
            "--set", "training.log_every=1"]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def was_killed(proc: subprocess.CompletedProcess) -> bool:
    """A SIGKILLed rank, not any failure: -9 for a plain process; the deepspeed launcher logs
    the rank's return code -9 and exits with it (sys.exit(-9), status 247)."""
    if proc.returncode == -signal.SIGKILL:
        return True
    logged = f"exits with return code = {-signal.SIGKILL}" in proc.stdout + proc.stderr
    return proc.returncode == 256 - signal.SIGKILL and logged


def metrics(output_dir: Path) -> list[dict]:
    with open(output_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_losses(output_dir: Path) -> list[float]:
    return [float(r["train_loss"]) for r in metrics(output_dir) if r["train_loss"]]


def whole_losses(output_dir: Path) -> list[float]:
    """``train_losses`` of the rows written whole: a rank ended at once (killed, or its liveness
    verdict's hard exit) while it wrote a row leaves that row cut short, without its line end
    (the next launch drops it as it resumes)."""
    text = (output_dir / "metrics.csv").read_text()
    whole = text if text.endswith("\n") else text[:text.rfind("\n") + 1]
    return [float(r["train_loss"]) for r in csv.DictReader(io.StringIO(whole)) if r["train_loss"]]


def checkpoint_steps(output_dir: Path) -> list[int]:
    root = output_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if "." not in p.name)


def model_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The module weights DeepSpeed saved (rank 0's model states file)."""
    states = torch.load(ckpt_dir / "state" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return states["module"]


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"


# What each rank prints when it stops on a signal after its checkpoint (training/callbacks/stop.py).
STOP_LINE = re.compile(r"rank (\d)/2: stopped at step (\d+) of \d+ after a complete checkpoint \((.*)\); exiting 0")


def foreign_tracebacks(text: str) -> list[str]:
    """Tracebacks other than the deepspeed runner's own KeyboardInterrupt on Ctrl-C (its code
    catches nothing around its wait; the ranks and launch.py are ours or handled)."""
    blocks = re.split(r"(?=Traceback \(most recent call last\):)", text)[1:]
    return [b for b in blocks if not ("deepspeed/launcher/runner.py" in b and "KeyboardInterrupt" in b.split("\n\n")[0])]


def group_processes(pgid: int) -> list[psutil.Process]:
    """The processes still in process group ``pgid``."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):  # gone meanwhile
            if os.getpgid(p.pid) == pgid:
                out.append(p)
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """A launcher started in a process group of its own (``start_new_session``) and all it
    started, killed and reaped: a failed test never leaves the runner, launch.py or a rank behind."""
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited already
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.stdout is not None and proc.stdout.closed:  # its output was read to the end already
        proc.wait()
    else:
        proc.communicate()


def ctrl_c_two_nodes(args: list[str], workdir: Path, node_args, ready, output_dir: Path, grace_s: float,
                     **env: str) -> tuple[str, int, float]:
    """Two nodes (``start_two_nodes``, each in a session of its own, as from a terminal per node)
    and, once ``ready()`` holds, Ctrl-C in each node's terminal (SIGINT to each launcher's process
    group): (what both said, the metrics rows logged when signalled, seconds until both exited).
    Whatever is left of either is killed."""
    procs, port = start_two_nodes(args, workdir, node_args, new_sessions=True, **env)
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert all(p.poll() is None for p in procs), "a node ended before it was signalled"
            assert time.monotonic() < deadline, "the run never came to the point to signal it"
            time.sleep(0.2)
        at = len(metrics(output_dir)) if (output_dir / "metrics.csv").exists() else 0
        signalled = time.monotonic()
        for proc in procs:
            os.killpg(proc.pid, signal.SIGINT)
        said = "".join(out + err for out, err in (p.communicate(timeout=grace_s + 60) for p in procs))
        return said, at, time.monotonic() - signalled
    finally:
        for proc in procs:
            if proc.poll() is None or group_processes(proc.pid):
                kill_group(proc)
        for seg in shm_segments(port):
            seg.unlink(missing_ok=True)


def one_stop(said: str, output_dir: Path) -> int:
    """Both ranks' stop lines name one step, no rank printed a traceback of its own, and that
    step's checkpoint is the run's only one and verifies: the step."""
    from ds_trhash.checkpoints import list_checkpoints, verify

    lines = STOP_LINE.findall(said)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"], said[-5000:]
    steps = {int(step) for _, step, _ in lines}
    assert len(steps) == 1, lines
    assert not foreign_tracebacks(said), said[-5000:]
    step = steps.pop()
    found = {c.step: c for c in list_checkpoints(output_dir)}
    assert list(found) == [step]
    ok, reason = verify(found[step].path, deep=True)
    assert ok, reason
    return step


class WatchedLaunch:
    """A launch of one launcher per node, started and not waited for: each launcher's output read
    as it comes (its pipe never fills, however long a fault keeps it running) and the time it
    ended, so that a test times what happens after ``fault_at``. ``port``: the master port, whose
    shared-memory segments ``cleanup`` removes."""

    def __init__(self, procs: list[subprocess.Popen], out: Path, port: int | None = None):
        self.procs, self.out, self.port = procs, out, port
        self.said: dict[int, str] = {}
        self.ended: dict[int, float] = {}
        self.fault_at: float | None = None
        self.readers = [threading.Thread(target=self._read, args=(n,), daemon=True) for n in range(len(procs))]
        for reader in self.readers:
            reader.start()

    def _read(self, node: int) -> None:
        out, err = self.procs[node].communicate()
        self.said[node] = out + err
        self.ended[node] = time.monotonic()

    def steps(self) -> int:
        return len(metrics(self.out)) if (self.out / "metrics.csv").exists() else 0

    def wait(self, nodes=(0, 1), timeout: float = 240.0) -> None:
        for node in nodes:
            self.readers[node].join(timeout)
            assert not self.readers[node].is_alive(), f"node {node} still runs {timeout:.0f} s on"

    def gone_after(self, node: int) -> float:
        return self.ended[node] - self.fault_at

    def cleanup(self) -> None:
        """Whatever is left of every launcher killed and reaped."""
        for proc in self.procs:
            if proc.poll() is None or group_processes(proc.pid):
                kill_group(proc)
        for seg in shm_segments(self.port) if self.port is not None else ():
            seg.unlink(missing_ok=True)


def assert_continues(launch: WatchedLaunch, reference: Path, last: bool) -> None:
    """The launch after a fault, with ``resumed_at`` (the step it continues from) and ``losses``
    (the rows it left written whole) set by its test: it says where it resumes, and every step it
    trained has the uninterrupted ``reference`` run's loss; the ``last`` launch ends on every node
    with exit 0 and on the reference's losses and final weights."""
    expected = train_losses(reference)
    assert f"resuming at step {launch.resumed_at}" in launch.said[0], launch.said[0][-3000:]
    assert 0 < launch.resumed_at < len(launch.losses) and launch.losses == expected[:len(launch.losses)]
    if last:
        for node in range(len(launch.procs)):
            assert launch.procs[node].returncode == 0, launch.said[node][-4000:]
        assert launch.losses == expected
        final = f"step_{REFERENCE_STEPS:08d}"
        assert_identical(model_weights(launch.out / "checkpoints" / final),
                         model_weights(reference / "checkpoints" / final))


def cached_shards(cache_dir: Path) -> set[str]:
    """The shards one node's cache holds (``<source>/<file>``), verified entries only."""
    return {p.relative_to(p.parents[1]).as_posix() for p in cache_dir.glob("*/*/*.bin")}


def metrics_inode(output_dir: Path) -> int | None:
    """The inode of ``output_dir``'s metrics.csv, None while there is none."""
    path = output_dir / "metrics.csv"
    return path.stat().st_ino if path.exists() else None


def resume_point(output_dir: Path) -> int:
    """The step --resume auto continues from: the newest complete checkpoint's (0: none)."""
    steps = checkpoint_steps(output_dir) if (output_dir / "checkpoints").is_dir() else []
    return steps[-1] if steps else 0


def fault_when_trained(launch: WatchedLaunch, fault, at_step: int, stale: int | None,
                       deadline_s: float = 400.0) -> None:
    """``fault(launch)`` once the launch has logged ``at_step`` steps, then ``launch.fault_at``.
    ``stale``: ``metrics_inode`` of the run before this launch started. A launch that resumes
    replaces metrics.csv as it starts (the rows past its checkpoint left out), so the rows of the
    file that was there are an earlier launch's and count for nothing."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert not launch.ended, "a node ended before its fault:\n" + "\n".join(launch.said.values())[-4000:]
        if metrics_inode(launch.out) != stale and launch.steps() >= at_step:
            fault(launch)
            launch.fault_at = time.monotonic()
            return
        assert time.monotonic() < deadline, f"never reached step {at_step}"
        time.sleep(0.05)
