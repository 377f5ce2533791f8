"""Where a plan's shards come from: ``open_store`` picks the store for a config and a plan.

``data.shards_dir`` null: the plan's own ``dataset`` + ``revision`` (an ``hf://datasets/...``
repository). ``data.shards_dir`` a directory: that directory. ``data.shards_dir``
``hf://datasets/OWNER/REPO[@REVISION]``: that repository (a mirror), at its revision or else
``main`` (the plan's revision names one of the original repository's).
"""
from __future__ import annotations

from typing import Mapping, Optional

from .base import ShardStore, StoreError, StoreFile, StoreUnavailable, relative_name
from .hub import HF_PREFIX, HubStore, parse_hf_url
from .local import LOCAL_COMMIT, LocalStore

__all__ = ["HubStore", "LocalStore", "LOCAL_COMMIT", "ShardStore", "StoreError", "StoreFile", "StoreUnavailable",
           "open_store", "relative_name"]


def open_store(shards_dir: Optional[str], plan_doc: Mapping, origin: str) -> ShardStore:
    """The store of a launch; ``origin`` names the config for messages."""
    if shards_dir is None:
        dataset, revision = plan_doc.get("dataset"), plan_doc.get("revision") or "main"
        if not isinstance(dataset, str) or not dataset.startswith(HF_PREFIX):
            raise StoreError(f"{origin}: data.shards_dir is null and the plan's dataset {dataset!r} is not an "
                             "hf://datasets/OWNER/REPO repository; set data.shards_dir to the shards' directory")
        repo, pinned = parse_hf_url(dataset, f"the plan's dataset")
        return HubStore(repo, pinned or str(revision))
    if shards_dir.startswith("hf://"):
        repo, revision = parse_hf_url(shards_dir, f"{origin}: data.shards_dir")
        return HubStore(repo, revision or "main")  # a mirror has its own branches
    return LocalStore(shards_dir)
