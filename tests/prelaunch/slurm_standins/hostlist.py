"""SLURM's host-list expansion for the stand-ins: "node[0-2,5],localhost" -> node0 node1 node2 node5 localhost."""
import re


def expand(hostlist: str) -> list[str]:
    parts = re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist)
    hosts = []
    for part in parts:
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if m is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(expand(f"{prefix}{str(n).zfill(len(lo))}{suffix}"))
    return hosts
