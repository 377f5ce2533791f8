"""A read-only or full output directory: one clear message per cause, no traceback on any rank,
the last complete checkpoint kept. The output directory is a small tmpfs mounted in a private
mount namespace (``unshare -m``), so these tests need the right to mount (root in a container)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ds_trhash.checkpoints import list_checkpoints, verify
from tests.training import launch_utils as L

pytestmark = pytest.mark.launch


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
