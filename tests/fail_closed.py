"""Helpers for the fail-closed tests: run the real `ds-trhash` command and prove that a refused
command changed nothing on disk."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under ``root`` with the SHA-256 of its bytes ("dir" for folders, "link" for links)."""
    root = Path(root)
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def flip_byte(path: Path) -> None:
    """One byte in the middle of ``path`` changed, its size kept: only its hash tells."""
    raw = bytearray(Path(path).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(raw))


def ds_trhash(*args: str, cwd: Path | None = None, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    e = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **env)
    return subprocess.run([str(VENV_BIN / "ds-trhash"), *map(str, args)], cwd=cwd or REPO, env=e,
                          capture_output=True, text=True, timeout=timeout)


def assert_clean_refusal(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    """Exit ``code``, each needle in stderr, and no traceback anywhere."""
    both = proc.stdout + proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}\n{both[-3000:]}"
    assert "Traceback" not in both, both[-3000:]
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} not in stderr:\n{proc.stderr[-3000:]}"
