"""What a failed launch's exception was: a disk that cannot take the run's files, or a collective
that failed because another rank is gone.

Recognised from the exception's type, errno and where it was raised, never from its text: a
message's words change between torch and gloo versions, its type and origin do not. The entry
point (``entrypoint.launch``) turns each answer into its one line and its exit code.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import torch.distributed as dist
import torch.serialization

# The errno values of an output side that cannot take the run's files any more: the run fails (exit 1).
_DISK_CAUSES = {
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EIO: "an I/O error on the device",
    errno.EFBIG: "the file grew beyond the size limit",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def describe_os_error(e: OSError) -> str:
    """One line naming the cause and the path, for the errors a full or read-only disk raises."""
    cause = _DISK_CAUSES.get(e.errno or -1, e.strerror or str(e))
    where = f" writing {e.filename}" if e.filename else ""
    return f"{cause}{where}"


def _raised_in(e: BaseException, module: object) -> bool:
    """Whether the innermost Python frame of ``e``'s traceback lies in ``module``'s package: a
    C++ error (torch.save's writer, a gloo collective) surfaces as a RuntimeError raised in the
    Python wrapper that called it."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    source = Path(str(getattr(module, "__file__", ""))).resolve()
    return where == source or (source.name == "__init__.py" and where.is_relative_to(source.parent))


def _filesystem_cause(output_dir: str) -> str:
    """Why a write under ``output_dir`` failed, read from its file system (read-only, full)."""
    target = Path(output_dir)
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        stats = os.statvfs(target)
    except OSError:
        return f"a checkpoint file could not be written under {output_dir}"
    if stats.f_flag & os.ST_RDONLY:
        return f"the file system of {output_dir} is read-only"
    if stats.f_bavail * stats.f_frsize < 64 * 2**20:
        return f"no space left on the device of {output_dir} ({stats.f_bavail * stats.f_frsize // 2**20} MiB free)"
    return f"a checkpoint file could not be written under {output_dir}"


def disk_failure(e: BaseException, output_dir: str) -> str | None:
    """The cause, when ``e`` is a failed write to disk: an OSError whose errno says the disk is
    full, read-only or failing, or a RuntimeError raised by torch.save's C++ writer (inside
    ``torch.serialization``), whose cause is then read from the file system. Recognised from the
    exception's type, errno and origin, never from its text."""
    for seen in _causes(e):
        if isinstance(seen, OSError) and seen.errno in _DISK_CAUSES:
            return describe_os_error(seen)
        if isinstance(seen, RuntimeError) and _raised_in(seen, torch.serialization):
            return _filesystem_cause(output_dir)
    return None


def peer_lost(e: BaseException, world: int) -> bool:
    """A collective failed because another rank exited (that rank reports its own cause):
    torch.distributed's own error types, or, on more than one rank, a RuntimeError raised out
    of torch.distributed (gloo reports a closed peer connection as a plain RuntimeError)."""
    return any(isinstance(seen, dist.DistError)
               or (world > 1 and isinstance(seen, RuntimeError) and _raised_in(seen, dist))
               for seen in _causes(e))


def _causes(e: BaseException, depth: int = 5) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or during (a few levels)."""
    chain: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and len(chain) < depth:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain
