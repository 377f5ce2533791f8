"""A read-only or full output directory: one clear message per cause, no traceback on any rank,
the last complete checkpoint kept; an output directory that is the filesystem root or the home
directory, and a master port already in use, refused with what to do. The output directory is a
small tmpfs mounted in a private mount namespace (``unshare -m``), so the disk tests need the
right to mount (root in a container)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.distributed

from ds_trhash.checkpoints import list_checkpoints, verify
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs a private mount namespace (unshare -m, mount)")


def _in_tmpfs(out, copy, size: str, launch: list[str], options: str = "") -> subprocess.CompletedProcess:
    """Run ``launch`` with ``out`` a fresh tmpfs of ``size``; afterwards copy it to ``copy``."""
    out.mkdir(parents=True, exist_ok=True)
    script = ('mount -t tmpfs -o size="$SIZE"$OPTS tmpfs "$OUT" || exit 99; "$@"; rc=$?; '
              'cp -a "$OUT" "$COPY"; exit $rc')
    env = L.base_env(SIZE=size, OPTS=options, OUT=str(out), COPY=str(copy))
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *launch], cwd=L.REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def _args(out, cache):
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "6",
            "--set", "checkpoint.every_steps=1", "--set", "checkpoint.packs=null", "--set", "batch.micro_batch=2",
            "--set", "training.log_every=1", "--set", f"data.cache_dir={cache}"]


@needs_mount
def test_a_disk_that_fills_up_ends_every_rank_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    out, copy = tmp_path / "run", tmp_path / "copy"
    port = L.free_port()
    launch = [str(L.VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
              str(L.REPO / "launch" / "train.py"), *_args(out, tmp_path / "cache")]
    try:
        # ~14 MiB per checkpoint of the tiny model (weights + Adam): the first fits, a later one does not.
        proc = _in_tmpfs(out, copy, "24m", launch)
    finally:
        for seg in L.shm_segments(port):
            seg.unlink(missing_ok=True)
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, L.explain(proc)
    assert "Traceback" not in both, both[-6000:]
    assert "error: rank 0: no space left on the device" in proc.stderr, L.explain(proc)
    assert "training stopped, the last complete checkpoint is kept" in proc.stderr
    rank1 = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1:")]
    assert len(rank1) <= 1  # its own cause or "lost contact with another rank", one line
    complete = [c for c in list_checkpoints(copy) if verify(c.path)[0]]
    assert complete, "the last complete checkpoint was lost"


@needs_mount
def test_a_read_only_output_directory_is_refused_at_launch(tmp_path):
    out, copy = tmp_path / "ro", tmp_path / "copy"
    proc = _in_tmpfs(out, copy, "1m", [str(L.VENV_BIN / "python"), str(L.REPO / "launch" / "train.py"),
                                        *_args(out, tmp_path / "cache")], options=",ro")
    assert proc.returncode == 2, L.explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"cannot write to {out}: Read-only file system" in proc.stderr
    assert not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------- the output side fails later


_RO_AFTER_FIRST_CHECKPOINT = r"""
mount -t tmpfs -o size=160m tmpfs "$OUT" || exit 99
# checkpoints/ is its own (bind) mount, so it can turn read-only while metrics.csv stays open
mkdir "$OUT/checkpoints" && mount --bind "$OUT/checkpoints" "$OUT/checkpoints" || exit 98
"$@" & pid=$!
until [ -f "$OUT/checkpoints/step_00000002/MANIFEST.json" ]; do kill -0 $pid 2>/dev/null || break; sleep 0.05; done
# between two saves nothing under checkpoints/ is open for writing: retry until the remount takes
until mount -o remount,bind,ro "$OUT/checkpoints" 2>/dev/null; do kill -0 $pid 2>/dev/null || break; sleep 0.02; done
touch "$SIGNALS/read-only"
wait $pid; rc=$?
cp -a "$OUT" "$COPY"; exit $rc
"""


@needs_mount
def test_output_turning_read_only_after_the_first_checkpoint_fails_every_rank_naming_the_path(tmp_path):
    out, copy, signals = tmp_path / "run", tmp_path / "copy", tmp_path / "signals"
    out.mkdir()
    signals.mkdir()
    port = L.free_port()
    args = [*_args(out, tmp_path / "cache"), "--max-steps", "40", "--set", "checkpoint.every_steps=2",
            "--set", "checkpoint.keep_last=2"]
    launch = [str(L.VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
              str(L.REPO / "launch" / "train.py"), *args]
    env = L.base_env(OUT=str(out), COPY=str(copy), SIGNALS=str(signals))
    try:
        proc = subprocess.run(["unshare", "-m", "sh", "-c", _RO_AFTER_FIRST_CHECKPOINT, "sh", *launch], cwd=L.REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        for seg in L.shm_segments(port):
            seg.unlink(missing_ok=True)
    assert (signals / "read-only").exists(), L.explain(proc)
    assert proc.returncode == 1, L.explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-6000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: rank ")]
    assert sorted(line.split(":")[1] for line in lines) == [" rank 0", " rank 1"], L.explain(proc)
    for line in lines:
        assert "read-only" in line and str(out / "checkpoints") in line, line
        assert line.endswith("training stopped, the last complete checkpoint is kept"), line
    complete = [c for c in list_checkpoints(copy) if verify(c.path)[0]]
    assert complete and max(c.step for c in complete) < 40, "the complete checkpoints were lost"


def test_refused_at_start_an_output_dir_at_the_root_or_home_and_a_master_port_in_use(tmp_path):
    """Three launches side by side, each refused with what to do and nothing written: --output-dir
    / and --output-dir ~ (before the process group exists), and a --master_port on which another
    launch's rank 0 holds its rendezvous store (this test holds one, as that launch would)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("# a home directory, not empty, holding no run\n")
    root_before, home_before = sorted(os.listdir("/")), tree_digest(home)
    port = L.free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)  # noqa: F841 (held)
    plain = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    train = str(L.REPO / "launch" / "train.py")
    cases = {
        "root": ([str(L.VENV_BIN / "python"), train, *_args(Path("/"), tmp_path / "cache")],
                 dict(plain, MASTER_PORT=str(L.free_port())),
                 ["error: --output-dir / is the filesystem root", "--output-dir runs/NAME"]),
        "home": ([str(L.VENV_BIN / "python"), train, *_args(home, tmp_path / "cache")],
                 dict(plain, MASTER_PORT=str(L.free_port())),
                 [f"error: --output-dir {home} is the home directory {home}", f"--output-dir {home / 'runs' / 'NAME'}"]),
        "port": ([str(L.VENV_BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(port), train,
                  *_args(tmp_path / "port-run", tmp_path / "cache")], {},
                 [f"error: the master port {port} on 127.0.0.1 is already in use", "deepspeed --master_port PORT"]),
    }
    procs = {name: subprocess.Popen(argv, cwd=L.REPO, env=L.base_env(HOME=str(home), **env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, (argv, env, _) in cases.items()}
    for name, (_, _, needles) in cases.items():
        stdout, stderr = procs[name].communicate(timeout=300)
        proc = subprocess.CompletedProcess(procs[name].args, procs[name].returncode, stdout, stderr)
        assert proc.returncode == 2, L.explain(proc)
        assert "Traceback" not in stdout + stderr, L.explain(proc)
        assert all(needle in stderr for needle in needles), L.explain(proc)
    assert sorted(os.listdir("/")) == root_before
    assert tree_digest(home) == home_before
    assert not (tmp_path / "cache").exists() and not (tmp_path / "port-run" / "checkpoints").exists()
