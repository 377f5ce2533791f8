"""The command line that starts a training launch: ``deepspeed launch/train.py --config ...``.

Shared by ``ds-trhash demo``, ``ds-trhash smoke`` and the tests, so that each starts a launch
the way a user does, through the ``deepspeed`` launcher, on a free loopback port.
"""
from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LAUNCH = REPO / "launch" / "train.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous port of a launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_command(config: str, nproc: int, extra: list[str]) -> list[str]:
    """The CPU launch form: the deepspeed launcher with --num_gpus N starts N CPU processes
    (gloo) on a machine without GPUs."""
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    return [launcher, "--num_gpus", str(nproc), "--master_port", str(free_port()),
            str(LAUNCH), "--config", config, *extra]
