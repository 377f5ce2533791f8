"""Where a plan's shards come from: ``open_store`` picks the store for a config and a plan.

``data.shards_dir`` null: the plan's own ``dataset`` + ``revision`` (an ``hf://datasets/...``
repository). ``data.shards_dir`` a directory: that directory. ``data.shards_dir``
``hf://datasets/OWNER/REPO[@REVISION]``: that repository (a mirror), at its revision or else
``main`` (the plan's revision names one of the original repository's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from ds_trhash.data.stream.store.base import (HF_PREFIX, ReadTimedOut, ShardStore, StoreError, StoreFile, StoreUnavailable,
                                              parse_hf_url, relative_name)
from ds_trhash.data.stream.store.local import LOCAL_COMMIT, LocalStore

if TYPE_CHECKING:  # the name HubStore, resolved by __getattr__ below when first used
    from ds_trhash.data.stream.store.hub import HubStore

__all__ = ["HubStore", "LocalStore", "LOCAL_COMMIT", "ReadTimedOut", "ShardStore", "StoreError", "StoreFile", "StoreUnavailable",
           "open_store", "relative_name"]


def __getattr__(name: str) -> type[HubStore]:
    # lazy: ``hub`` imports huggingface_hub and its HTTP client (~0.3 s of every launch's start);
    # only a launch that reads from the Hub needs it
    if name == "HubStore":
        from ds_trhash.data.stream.store.hub import HubStore

        return HubStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hub_store(repo_id: str, revision: str, hub_wait_s: Optional[float]) -> ShardStore:
    from ds_trhash.data.stream.store.hub import HubStore  # lazy, as above

    return HubStore(repo_id, revision) if hub_wait_s is None else HubStore(repo_id, revision, budget_s=hub_wait_s)


def open_store(shards_dir: Optional[str], plan_doc: Mapping, origin: str,
               hub_wait_s: Optional[float] = None) -> ShardStore:
    """The store of a launch; ``origin`` names the config for messages. ``hub_wait_s``: how long
    a Hub store waits out an outage (``data.hub_wait_minutes``; None: the default 30 minutes)."""
    if shards_dir is None:
        dataset, revision = plan_doc.get("dataset"), plan_doc.get("revision") or "main"
        if not isinstance(dataset, str) or not dataset.startswith(HF_PREFIX):
            raise StoreError(f"{origin}: data.shards_dir is null and the plan's dataset {dataset!r} is not an "
                             "hf://datasets/OWNER/REPO repository; set data.shards_dir to the shards' directory")
        repo, pinned = parse_hf_url(dataset, f"the plan's dataset")
        return _hub_store(repo, pinned or str(revision), hub_wait_s)
    if shards_dir.startswith("hf://"):
        repo, revision = parse_hf_url(shards_dir, f"{origin}: data.shards_dir")
        return _hub_store(repo, revision or "main", hub_wait_s)  # a mirror has its own branches
    return LocalStore(shards_dir)
