"""A corpus in a local (or mounted) directory: the store of ``data.shards_dir: /some/dir``."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ds_trhash.data.stream.store.base import StoreError, StoreFile, copy_hashing, relative_name

_CHUNK = 1 << 20
LOCAL_COMMIT = "local"  # a directory has no revisions: its commit is this word


class LocalStore:
    def __init__(self, root: os.PathLike | str) -> None:
        self.root = Path(root)
        self.description = str(self.root)
        self.identity = f"local:{self.root.resolve()}"

    def _path(self, path: str) -> Path:
        full = self.root / relative_name(path, f"shard store {self.root}")
        if not full.resolve().is_relative_to(self.root.resolve()):
            raise StoreError(f"shard store {self.root}: {path!r} leads outside the store (a symlink?)")
        return full

    def resolve(self, pinned: Optional[str] = None) -> str:
        if not self.root.is_dir():
            raise StoreError(f"data.shards_dir {self.root} is not a directory; point it at the tokenized shards")
        return LOCAL_COMMIT

    def pin(self, commit: str) -> None:
        pass  # a directory has one state

    def warm_up(self) -> None:
        """Nothing to set up: a copy needs no client."""

    def list_files(self) -> dict[str, StoreFile]:
        """One stat per file (no reads): the cost does not grow with the corpus bytes."""
        found: dict[str, StoreFile] = {}
        root = self.root.resolve()
        for folder, _, files in os.walk(self.root):
            for name in files:
                full = os.path.join(folder, name)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if os.path.islink(full) and not Path(full).resolve().is_relative_to(root):
                    raise StoreError(f"shard store {self.root}: {rel} is a symlink that leads outside the store; "
                                     "copy the file in, or remove the link")
                found[rel] = StoreFile(rel, os.stat(full).st_size)
        return found

    def read_json(self, path: str) -> object:
        full = self._path(path)
        try:
            return json.loads(full.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StoreError(f"{full} is missing; run `ds-trhash data tokenize` for that source first") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"{full} is not valid UTF-8 JSON: {exc}") from None

    def download(self, path: str, dest: Path, size: int) -> str:
        """Copy the file into ``dest``; returns the sha256 of the bytes copied (hashed on the way)."""
        src = self._path(path)
        try:
            return copy_hashing(src, dest, _CHUNK)
        except FileNotFoundError:
            raise StoreError(f"shard {src} is missing from the shard store") from None
