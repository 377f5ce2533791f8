"""Private files written whole or not at all (moves into ds_trhash.io with the structure work)."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text``: a temporary created with ``mode`` beside it (never readable by
    others, not even for a moment), fsynced, then renamed over it."""
    out = Path(path)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # O_CREAT's mode is filtered by the umask
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
