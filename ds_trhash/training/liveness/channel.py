"""The liveness channel: UDP datagrams between the ranks, beside the training collectives.

Why UDP and not the process group: a rank blocked in a collective (its peer gone, frozen or
stuck) cannot also take part in another one, and NCCL collectives would go through the device
stream that may be what is stuck. A datagram needs no connection, no handshake and no peer that
answers: a lost peer costs nothing but its silence, which is what is measured. Each datagram is a
small JSON object carrying the launch's token (so that another launch on the same hosts is never
heard) and the sender's rank.

Every rank learns the others' addresses once, at start-up, through the rendezvous store the
process group was made with (``exchange``); after that nothing depends on the store (it lives in
rank 0's process, whose loss must still be named).
"""
from __future__ import annotations

import json
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ds_trhash.network import GLOO_VARIABLE, gloo_interface_in_use, resolve_master, route_source
from ds_trhash.ranks import ranks_on_node

STORE_PREFIX = "ds_trhash/liveness/"
MAX_DATAGRAM = 2048
NODE_VARIABLES = ("CROSS_RANK", "GROUP_RANK", "NODE_RANK", "SLURM_NODEID")  # deepspeed, torchrun, SLURM


@dataclass(frozen=True)
class PeerInfo:
    """Who a rank is and where its liveness socket listens."""

    rank: int
    node: int
    host: str
    address: str
    port: int


def host_name(env: Mapping[str, str] | None = None) -> str:
    """The node's name as the scheduler knows it (``SLURMD_NODENAME``), else the host's."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def node_index(rank: int, world: int, env: Mapping[str, str] | None = None) -> int:
    """This rank's node: the launcher's node rank, else the rank over the ranks per node."""
    env = os.environ if env is None else env
    for name in NODE_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return rank // max(1, ranks_on_node(world, env))


def local_address(master: str) -> str:
    """The address the other nodes reach this one at: that of the interface the launch chose for
    gloo (``ds_trhash.network``; it is right where the route's is not, e.g. on a master node whose
    own name is its loopback), else the local address of the route to ``master``."""
    chosen = gloo_interface_in_use()
    if chosen is not None and chosen.address and os.environ.get(GLOO_VARIABLE) == chosen.name:
        return chosen.address
    return route_source(resolve_master(master)[0])


class Store(Protocol):
    """torch.distributed's key-value store, by the two calls used here."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...


class Channel:
    """One rank's UDP socket: ``send`` a message to every peer, ``receive`` what arrived."""

    def __init__(self, address: str, token: str = "", port: int = 0):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((address, port))
        self.address, self.port = address, self.sock.getsockname()[1]
        self.token = token
        self.peers: list[PeerInfo] = []

    def send(self, message: dict[str, Any], peers: list[PeerInfo] | None = None) -> None:
        """One datagram to each peer; an unreachable one (a link down, a host gone) is skipped."""
        data = json.dumps({**message, "t": self.token}, separators=(",", ":")).encode()
        for peer in self.peers if peers is None else peers:
            try:
                self.sock.sendto(data, (peer.address, peer.port))
            except OSError:  # ENETUNREACH, EHOSTUNREACH, ECONNREFUSED from an earlier ICMP: silence
                pass

    def receive(self, timeout: float, until: threading.Event | None = None) -> list[dict[str, Any]]:
        """The messages of this launch that arrive within ``timeout`` s (all of it: the caller's
        interval, unless ``until`` is set meanwhile and a datagram wakes it: ``wake``), or are
        already queued; anything else (another launch, garbage) is dropped."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + max(0.0, timeout)
        while until is None or not until.is_set():
            wait = max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], wait)[0]:
                if wait <= 0.0 or time.monotonic() >= deadline:
                    return out
                continue
            try:
                data = self.sock.recv(MAX_DATAGRAM)
            except OSError:  # an ICMP error reported on this socket: nothing to read
                continue
            message = _decode(data)
            if message is not None and message.get("t") == self.token:
                out.append(message)
        return out

    def wake(self) -> None:
        """An empty datagram to this socket: a ``receive`` waiting on it looks at ``until`` again."""
        try:
            self.sock.sendto(b"", (self.address, self.port))
        except OSError:  # the interface went down: the receive's own timeout wakes it within an interval
            pass

    def close(self) -> None:
        self.sock.close()


def _decode(data: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) and isinstance(message.get("r"), int) else None


def exchange(store: Store, me: PeerInfo, world: int) -> tuple[list[PeerInfo], str]:
    """Every rank's ``PeerInfo`` and the launch's token, through the store (once, at start-up):
    rank 0 draws the token; each rank publishes itself and reads the others (waiting for them)."""
    if me.rank == 0:
        store.set(STORE_PREFIX + "token", secrets.token_hex(8))
    store.set(STORE_PREFIX + str(me.rank), json.dumps(asdict(me)))
    token = _text(store.get(STORE_PREFIX + "token"))
    peers = [PeerInfo(**json.loads(_text(store.get(STORE_PREFIX + str(r))))) for r in range(world) if r != me.rank]
    return peers, token


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
