"""Where the node's shard cache may live, checked before training starts.

- **Node-local by default.** With ``data.cache_dir`` null the cache is ``$DS_TRHASH_CACHE_DIR``, else
  ``$TMPDIR/ds-trhash-<uid>/shard_cache`` (``/tmp`` without ``TMPDIR``): node-local on the usual
  cluster set-ups (schedulers point ``TMPDIR`` at the node's scratch disk), where the cache's
  ``flock`` pins and locks are reliable. The output directory is usually on a shared filesystem in
  a multi-node job, which is why the cache no longer defaults to it.
- **Not on a network filesystem** unless the user says so (``data.cache_on_network_fs: true``):
  NFS, Lustre, GPFS, CIFS/SMB and FUSE mounts do not give every client ``flock`` semantics, and
  a cache shared by several nodes through one would be pinned and evicted by ranks that cannot see
  each other's locks. The type is the one ``/proc/mounts`` gives for the longest mount point above
  the folder.
- **Only the cache's own folder.** The cache writes a marker (``CACHE_MARKER``) when it first
  creates its folder; an existing folder without the marker that holds anything is somebody else's
  and is refused, naming a file in it, so the cache never deletes or replaces a file it did not
  write. Inside a marked folder the cache touches only entries of its own layout.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from ds_trhash.data.stream.cache.files import CacheError

CACHE_MARKER = ".ds-trhash-shard-cache"
NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "fuse", "beegfs", "ceph", "glusterfs",
              "9p", "afs")
MOUNTS = "/proc/mounts"


CACHE_DIR_ENV = "DS_TRHASH_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$DS_TRHASH_CACHE_DIR`` (a site's node-local scratch), else
    ``$TMPDIR/ds-trhash-<uid>/shard_cache``: node-local scratch, one per user."""
    named = os.environ.get(CACHE_DIR_ENV)
    return Path(named) if named else Path(tempfile.gettempdir()) / f"ds-trhash-{os.getuid()}" / "shard_cache"


def cache_dir_of(configured: Optional[str]) -> Path:
    """The cache folder a launch uses: ``data.cache_dir``, else ``default_cache_dir()``."""
    return Path(configured) if configured else default_cache_dir()


def filesystem_type(path: Path, mounts: str = MOUNTS) -> Optional[str]:
    """The type of the filesystem holding ``path`` (its nearest existing parent), or None when
    the mount table cannot be read."""
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent
    target = target.resolve()
    try:
        lines = Path(mounts).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == Path(point) or Path(point) in target.parents) and len(point) > best:
            best, kind = len(point), fields[2]
    return kind


def _is_network(kind: Optional[str]) -> bool:
    return kind is not None and (kind in NETWORK_FS or kind.split(".")[0] in NETWORK_FS)


def _cache_layout(folder: Path) -> bool:
    """Every top-level entry is one of the cache's per-store folders (16 hex digits) or its
    eviction lock: a cache of ours written before it marked its folders."""
    names = [p.name for p in folder.iterdir()]
    return bool(names) and all(n == ".evict.lock" or (len(n) == 16 and all(c in "0123456789abcdef" for c in n))
                               for n in names)


def foreign_file(folder: Path) -> Optional[Path]:
    """A file in an existing, unmarked ``folder`` (the first one found), or None."""
    if not folder.is_dir() or (folder / CACHE_MARKER).is_file() or _cache_layout(folder):
        return None
    return next((p for p in sorted(folder.rglob("*")) if not p.is_dir()), None)


def check_cache_place(folder: Path, setting: str, network_ok: bool, mounts: str = MOUNTS) -> None:
    """Refuse, before anything is written, a cache folder that is a file, belongs to somebody
    else, or lies on a network filesystem the user has not vouched for."""
    if folder.exists() and not folder.is_dir():
        raise CacheError(f"{setting} {folder} is a file; name a folder for the node's shard cache")
    stranger = foreign_file(folder)
    if stranger is not None:
        raise CacheError(f"{setting} {folder} already holds files the shard cache did not write (for example "
                         f"{stranger}); the cache would evict them: name an empty or new folder, or the cache's own "
                         f"(it carries {CACHE_MARKER})")
    kind = filesystem_type(folder, mounts)
    if _is_network(kind) and not network_ok:
        raise CacheError(f"{setting} {folder} is on a {kind} filesystem, where file locks are not reliable across "
                         "clients: put the cache on node-local disk (data.cache_dir null uses "
                         f"{default_cache_dir()}), or set data.cache_on_network_fs: true if this mount locks correctly "
                         "and only this node uses the folder")


def claim(folder: Path) -> Path:
    """Create the cache folder (and its marker) once every check passed; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / CACHE_MARKER
    if not marker.exists():
        marker.write_text("a ds-trhash shard cache: entries here are created, replaced and evicted by it\n",
                          encoding="utf-8")
    return folder
