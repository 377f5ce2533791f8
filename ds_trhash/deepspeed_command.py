"""The command line that starts a training launch: ``deepspeed launch/train.py --config ...``.

Shared by ``ds-trhash demo``, ``ds-trhash smoke`` and the tests, so that each starts a launch
the way a user does, through the ``deepspeed`` launcher, on a free loopback port.
"""
from __future__ import annotations

import random
import shutil
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch" / "train.py"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (source ports of outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous port of a launch).

    It is drawn below the kernel's ephemeral range: a launch binds its port seconds after it was
    chosen (the imports of every rank; longer on a loaded machine), and a port in that range can be
    taken meanwhile as the source port of any outgoing connection (gloo opens several per rank).
    Only an explicit bind competes for the ports below it."""
    top = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(256):
        port = draw.randrange(max(1024, top - 16384), top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or in TIME_WAIT): draw again
                continue
            return port
    with socket.socket() as s:  # that range is full: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_command(config: str, nproc: int, extra: list[str]) -> list[str]:
    """The CPU launch form: the deepspeed launcher with --num_gpus N starts N CPU processes
    (gloo) on a machine without GPUs."""
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    return [launcher, "--num_gpus", str(nproc), "--master_port", str(free_port()),
            str(LAUNCH), "--config", config, *extra]
