"""Hosts on a real network for tests: each a Linux network namespace of its own, its interfaces,
routes and loopback apart from every other, cabled to one switch (a bridge in a namespace of its
own). A launcher started inside one (``Hosts.run``) sees only its own host: 127.0.0.1 is its own
loopback, and its peers are reached over its cable, which a test can cut (``cut``) as when a
cable or a switch dies.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544), one /24 per ``Hosts``
derived from the pid and a counter; namespace and device names carry the pid too, so tests of
sessions running at once never meet. Everything made is removed on leaving the ``with`` block,
a failed test included. ``namespaces_forbidden`` and ``netem_missing`` say why a test must skip,
found by trying.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import subprocess
import threading
from pathlib import Path

import pytest

_serial = itertools.count()
CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One ``ip`` command; a failure raises with what it said."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


class Hosts:
    """``count`` hosts on one switch, host ``i`` at ``address(i)`` on device ``device(i)``."""

    def __init__(self, count: int = 2):
        serial = next(_serial)
        self.tag = f"{os.getpid()}x{serial}"  # <= 7 + 1 + 3 characters: device names stay under 15
        subnet = (os.getpid() * 8 + serial) % 512  # one /24 of 198.18.0.0/15
        self.prefix = f"198.{18 + subnet // 256}.{subnet % 256}"
        self.count = count
        self.switch = f"sw{self.tag}"
        self.namespaces = [f"h{i}n{self.tag}" for i in range(count)]
        self._made: list[tuple[str, ...]] = []  # the deletions, in reverse order of creation

    def address(self, i: int) -> str:
        return f"{self.prefix}.{i + 1}"

    def device(self, i: int) -> str:
        return f"h{i}e{self.tag}"

    def __enter__(self) -> "Hosts":
        try:
            self._made.append(("netns", "del", self.switch))
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.count):
                self._cable(i)
        except BaseException:
            self.close()
            raise
        return self

    def _cable(self, i: int) -> None:
        """Host ``i``: its namespace (loopback up) and a cable from its device to the switch."""
        ns, dev, port = self.namespaces[i], self.device(i), f"s{i}p{self.tag}"
        self._made.append(("netns", "del", ns))
        ip("netns", "add", ns)
        self._made.append(("link", "del", dev))  # a pair made here but not yet moved lives in this namespace
        ip("link", "add", dev, "type", "veth", "peer", "name", port)
        ip("link", "set", dev, "netns", ns)
        ip("link", "set", port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", dev)
        ip("-n", ns, "link", "set", dev, "up")
        ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Remove what was made, the last first; a device already gone with its namespace is fine."""
        while self._made:
            ip(*self._made.pop(), check=False)

    def __exit__(self, *exc) -> None:
        self.close()

    def cut(self, i: int) -> None:
        """Host ``i``'s cable unplugged: its device down (its peers' traffic to it goes nowhere)."""
        ip("-n", self.namespaces[i], "link", "set", self.device(i), "down")

    def mend(self, i: int) -> None:
        ip("-n", self.namespaces[i], "link", "set", self.device(i), "up")

    def slow(self, i: int, *netem: str) -> None:
        """Host ``i``'s outgoing traffic through ``tc netem`` (e.g. ``"delay", "20ms", "loss", "1%"``)."""
        subprocess.run(["tc", "-n", self.namespaces[i], "qdisc", "replace", "dev", self.device(i), "root", "netem",
                        *netem], check=True, capture_output=True, timeout=30)

    def command(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on host ``i`` (``ip netns exec`` execs it: the process is the command itself)."""
        return ["ip", "netns", "exec", self.namespaces[i], *cmd]

    def inside(self, i: int, fn):
        """``fn()`` called in this process on a thread that entered host ``i``'s network namespace
        (sockets and interface lists it makes are that host's); its result, or its exception."""
        return inside_namespace(Path("/run/netns") / self.namespaces[i], fn)


def inside_namespace(path: Path, fn):
    """``fn()`` on a fresh thread moved into the network namespace at ``path`` (setns(2) moves the
    calling thread only, so the rest of the process stays where it was)."""
    result: dict = {}

    def body():
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {path}")
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc
        finally:
            os.close(fd)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def namespaces_forbidden() -> str | None:
    """Why this machine cannot make network namespaces, or None (found by making one)."""
    try:
        with Hosts(1):
            return None
    except (OSError, RuntimeError) as exc:
        return f"network namespaces cannot be made here ({exc})"


def hosts_or_skip(count: int = 2) -> Hosts:
    """``Hosts(count)`` to enter, or the calling test skipped saying why namespaces cannot be made here."""
    why = namespaces_forbidden()
    if why:
        pytest.skip(why)
    return Hosts(count)


def netem_missing() -> str | None:
    """Why ``tc netem`` cannot slow a link here, or None (tried on a throwaway host)."""
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(Hosts(1))
        except (OSError, RuntimeError) as exc:
            return f"network namespaces cannot be made here ({exc})"
        try:
            proc = subprocess.run(["tc", "-n", hosts.namespaces[0], "qdisc", "add", "dev", hosts.device(0), "root",
                                   "netem", "delay", "20ms"], capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            return "there is no tc command here (iproute2's tc slows a link with netem)"
        if proc.returncode != 0:
            return f"the kernel has no tc netem here (tc qdisc add ... netem: {proc.stderr.strip() or proc.returncode})"
    return None
