"""The network interface gloo connects ranks over, chosen by the launch unless the user set
``GLOO_SOCKET_IFNAME``.

Why: without ``GLOO_SOCKET_IFNAME``, gloo binds its connections to the address the host's own
name resolves to, and many hosts map their name to 127.0.0.1 or 127.0.1.1 in /etc/hosts. Every
rank then tells its peers to connect to a loopback address: a rank on another node is refused
(or waits in its connect) and the launch never starts. The launch instead picks the interface
that reaches the master: on the master's node the interface holding the master address, on any
other node the interface of the route to it (a UDP socket's ``connect`` asks the kernel for the
source address; nothing is sent). Loopback between hosts is refused, and so is a master no
interface reaches, naming MASTER_ADDR, what was tried and how to fix it.

The choice is made before the process group starts and stays in the environment, so every gloo
group of the launch uses it: the CPU training groups, and on GPUs the gloo side groups beside
NCCL (the stop agreement, the row exchange). NCCL chooses its own interface
(``NCCL_SOCKET_IFNAME`` overrides it; docs/operations.md). Imports nothing of ours but errors.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import MutableMapping

import psutil

from ds_trhash.errors import UserError

GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
NCCL_VARIABLE = "NCCL_SOCKET_IFNAME"
_PROBE_PORT = 9  # the discard port: a UDP connect only picks a route, it sends nothing
_RTF_UP, _RTF_REJECT = 0x0001, 0x0200  # a route's flags (linux/route.h): usable; unreachable (no way out)


class NetworkError(UserError):
    """No interface of this host reaches the master (each node meets its own routes, so every
    rank says it)."""

    per_rank = True


@dataclass(frozen=True)
class GlooInterface:
    """The interface gloo uses on this host: its name, this host's address on it, and why."""

    name: str
    address: str  # empty when GLOO_SOCKET_IFNAME chose it
    reason: str

    def describe(self) -> str:
        at = f" ({self.address}: {self.reason})" if self.address else f" ({self.reason})"
        return f"gloo over {self.name}{at}"


def _bare(address: str) -> str:
    """An address without its IPv6 zone (``fe80::1%eth0`` -> ``fe80::1``), for comparison."""
    return address.split("%", 1)[0]


def local_addresses() -> dict[str, list[str]]:
    """Every interface of this host (of its network namespace) and its IPv4/IPv6 addresses."""
    families = (socket.AF_INET, socket.AF_INET6)
    return {name: [_bare(a.address) for a in addrs if a.family in families]
            for name, addrs in psutil.net_if_addrs().items()}


def is_loopback(name: str, addresses: list[str]) -> bool:
    """Whether an interface is a loopback device (its flags, else its addresses)."""
    stats = psutil.net_if_stats().get(name)
    if stats is not None and "loopback" in getattr(stats, "flags", "").split(","):
        return True
    return any(ipaddress.ip_address(a).is_loopback for a in addresses)


def resolve_master(master: str) -> list[str]:
    """The master address as IP addresses, in the resolver's order (a name or a literal)."""
    try:
        infos = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise NetworkError(
            f"MASTER_ADDR={master} does not resolve on this host ({exc}); pass the master node's IP address "
            f"(deepspeed --master_addr) or a name every node resolves") from None
    return list(dict.fromkeys(_bare(str(info[4][0])) for info in infos))


def route_source(address: str) -> str:
    """This host's source address toward ``address``: the kernel's route, asked by a UDP connect."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, _PROBE_PORT))
        return _bare(probe.getsockname()[0])


def _routes(version: int) -> list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]]:
    """The main routing table of this thread's network namespace: (destination, device) pairs."""
    path = f"/proc/thread-self/net/{'route' if version == 4 else 'ipv6_route'}"
    try:
        with open(path) as f:
            rows = [line.split() for line in f.read().splitlines()[1 if version == 4 else 0:] if line.strip()]
    except OSError:
        return []  # no table to read: the route's source address alone decides
    flags = 3 if version == 4 else 8
    rows = [r for r in rows if int(r[flags], 16) & _RTF_UP and not int(r[flags], 16) & _RTF_REJECT]
    if version == 4:  # Iface, Destination, ..., Mask: little-endian hex
        return [(ipaddress.IPv4Network((int.from_bytes(bytes.fromhex(r[1]), "little"),
                                        bin(int.from_bytes(bytes.fromhex(r[7]), "little")).count("1")), strict=False), r[0])
                for r in rows]
    return [(ipaddress.IPv6Network((int(r[0], 16), int(r[1], 16)), strict=False), r[9]) for r in rows]


def route_device(address: str) -> str | None:
    """The device the main table's longest matching route leaves through (None: no table or route)."""
    ip = ipaddress.ip_address(address)
    matching = [(net.prefixlen, dev) for net, dev in _routes(ip.version) if ip in net]
    return max(matching)[1] if matching else None


def _holder(address: str, interfaces: dict[str, list[str]]) -> str | None:
    """The interface holding ``address``, if this host has it."""
    return next((name for name, addrs in interfaces.items() if address in addrs), None)


def _try_address(address: str, interfaces: dict[str, list[str]]) -> tuple[GlooInterface | None, str]:
    """(the interface reaching ``address``, or None and why not)."""
    held = _holder(address, interfaces)
    if held is not None:
        return GlooInterface(held, address, "holds the master address"), ""
    try:
        source = route_source(address)
    except OSError as exc:
        return None, f"{address}: no route ({exc.strerror or exc})"
    name = _holder(source, interfaces)
    if name is None:
        return None, f"{address}: the route's source address {source} is on no interface"
    if ipaddress.ip_address(address).is_loopback:  # 127.0.1.1 and the like: this host, over loopback
        return GlooInterface(name, source, f"the master {address} is this host"), ""
    device = route_device(address) or name
    if is_loopback(name, interfaces[name]) or is_loopback(device, interfaces.get(device, [])):
        return None, (f"{address}: the route leaves through the loopback interface {device}, which never reaches "
                      "another host")
    return GlooInterface(name, source, f"the route to the master {address}"), ""


def loopback_name(master: str, addresses: list[str]) -> bool:
    """Whether ``master`` is a host name (not an address, not ``localhost``) this host resolves to
    loopback only: its own name, mapped to 127.0.0.1 or 127.0.1.1 in /etc/hosts."""
    try:
        ipaddress.ip_address(master)
        return False
    except ValueError:
        return master.lower() != "localhost" and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def outward_interface(master: str, addresses: list[str], interfaces: dict[str, list[str]]) -> GlooInterface:
    """The master's node, named by a host name it maps to loopback, in a job of several nodes: the
    interface of its default route (the others reach it over that network, not over its loopback)."""
    for version in (4, 6):
        for net, device in _routes(version):
            held = [a for a in interfaces.get(device, []) if ipaddress.ip_address(a).version == version]
            if net.prefixlen == 0 and held and not is_loopback(device, interfaces[device]):
                return GlooInterface(device, held[0], f"the default route's: the master name {master} is this host's "
                                                      f"loopback {addresses[0]} here")
    raise NetworkError(
        f"MASTER_ADDR={master} resolves to the loopback address {', '.join(addresses)} on this node, which the other "
        "nodes cannot reach, and no default route names another interface; pass this node's address on the nodes' "
        f"network as the master address (deepspeed --master_addr), map {master} to it in /etc/hosts, or set "
        f"{GLOO_VARIABLE} to the interface the other nodes reach")


def choose_gloo_interface(master: str, interfaces: dict[str, list[str]] | None = None,
                          several_nodes: bool = False) -> GlooInterface:
    """The interface that reaches the master ``master`` (a name or an address): the one holding
    it on the master's node, else the one its route leaves through; never loopback toward another
    host. ``several_nodes``: the job has ranks on other nodes (a master name this host maps to
    loopback then means the default route's interface). Refused (``NetworkError``) when none does."""
    interfaces = local_addresses() if interfaces is None else interfaces
    addresses = resolve_master(master)
    if several_nodes and loopback_name(master, addresses):
        return outward_interface(master, addresses, interfaces)
    tried = []
    for address in addresses:
        found, why = _try_address(address, interfaces)
        if found is not None:
            return found
        tried.append(why)
    named = ", ".join(sorted(interfaces)) or "none"
    raise NetworkError(
        f"no network interface of this host reaches the master MASTER_ADDR={master}: tried {'; '.join(tried)} "
        f"(interfaces here: {named}); check the route to it (`ip route get {master}`) and the master address "
        f"(deepspeed --master_addr), or set {GLOO_VARIABLE} to the interface that reaches it")


def _named_by_user(value: str, interfaces: dict[str, list[str]]) -> GlooInterface:
    """``GLOO_SOCKET_IFNAME`` as the user set it (gloo takes a comma-separated list), each name checked."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    missing = [n for n in names if n not in interfaces]
    if missing:
        raise NetworkError(
            f"{GLOO_VARIABLE}={value} names {', '.join(missing)}, which this host does not have (its interfaces: "
            f"{', '.join(sorted(interfaces)) or 'none'}); set it to the interface that reaches the master, or unset "
            "it and the launch chooses that one")
    return GlooInterface(",".join(names), "", f"set by {GLOO_VARIABLE}")


_in_use: GlooInterface | None = None


def use_gloo_interface(env: MutableMapping[str, str] = os.environ, several_nodes: bool = False) -> GlooInterface:
    """Set ``GLOO_SOCKET_IFNAME`` in ``env`` to the interface reaching MASTER_ADDR, unless the user
    set it (then checked, and kept): the choice, also what ``gloo_interface_in_use`` says after.
    ``several_nodes``: whether the job has ranks on other nodes (``choose_gloo_interface``)."""
    global _in_use
    if _in_use is not None and env.get(GLOO_VARIABLE) == _in_use.name:
        return _in_use  # this process chose it already (a second group start in the same process)
    interfaces = local_addresses()
    if env.get(GLOO_VARIABLE, "").strip():
        _in_use = _named_by_user(env[GLOO_VARIABLE], interfaces)
    else:
        _in_use = choose_gloo_interface(env.get("MASTER_ADDR", "127.0.0.1"), interfaces, several_nodes)
        env[GLOO_VARIABLE] = _in_use.name
    return _in_use


def gloo_interface_in_use() -> GlooInterface | None:
    """What ``use_gloo_interface`` chose in this process (None before it ran)."""
    return _in_use


def describe_network(gpu: bool) -> str:
    """The start-up summary's network line: gloo's interface, and on GPUs who chooses NCCL's."""
    chosen = gloo_interface_in_use()
    line = chosen.describe() if chosen is not None else "gloo's own choice (no process group started here)"
    if gpu:
        nccl = os.environ.get(NCCL_VARIABLE, "").strip()
        line += f"; NCCL over {nccl} ({NCCL_VARIABLE})" if nccl else f"; NCCL's own choice ({NCCL_VARIABLE} overrides)"
    return line
