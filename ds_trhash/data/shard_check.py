"""Are the shards a plan names all there, whole and unchanged?

A replay plan names shard files by source; their manifests record each file's size and
SHA-256. A missing or truncated shard is found by listing sizes, which costs nothing even for
hundreds of gigabytes; a changed byte only by hashing every file, which takes as long as
reading the corpus once, so that is asked for explicitly (``deep``). The shard cache hashes
each shard anyway when a run first copies it, before a row of it is trained on.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ds_trhash.io import sha256_file

from .plan import PlanLike, plan_doc


def shard_bytes(entry: Mapping) -> int:
    """A manifest entry's file size (manifests before the ``bytes`` field: two bytes per token)."""
    return int(entry.get("bytes", int(entry["tokens"]) * 2))


def planned_shards(plan: PlanLike, manifests: Mapping[str, Mapping]) -> list[tuple[str, Mapping]]:
    """(source, manifest entry) of every shard the plan reads, once each, in plan order."""
    seen: dict[tuple[str, str], tuple[str, Mapping]] = {}
    for phase in plan_doc(plan)["phases"]:
        for source, entries in phase["sources"].items():
            by_file = {s["file"]: s for s in manifests[source]["shards"]}
            for entry in entries:
                seen.setdefault((source, entry["file"]), (source, by_file[entry["file"]]))
    return list(seen.values())


def check_plan_shards(shards_dir: str | Path, plan: PlanLike, manifests: Mapping[str, Mapping],
                      deep: bool = False) -> tuple[int, int, list[str]]:
    """(shards checked, their bytes, problems): every planned shard exists with its manifest
    size, and with ``deep`` its manifest SHA-256. ``manifests`` come from
    ``reader.source_manifests``, which already matched them to the plan."""
    problems: list[str] = []
    shards = planned_shards(plan, manifests)
    total = 0
    for source, entry in shards:
        path = Path(shards_dir) / source / entry["file"]
        size = shard_bytes(entry)
        total += size
        if not path.is_file():
            problems.append(f"{path} is missing (the plan reads it)")
        elif path.stat().st_size != size:
            problems.append(f"{path} has {path.stat().st_size} bytes, its manifest records {size}")
        elif deep and sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: SHA-256 differs from its manifest ({entry['sha256'][:12]}…)")
    return len(shards), total, problems
