"""One corpus from pretraining on: the commit and the bytes a run first read are the run's corpus.

A launch records what it read (``Corpus.record``: the store, the revision asked for, the commit it
resolved to, every planned shard's SHA-256). A resume reads its own record; refinement reads the
record of the pretraining checkpoint it starts from. Then:

- the same Hub repository is read at the recorded commit, never at what its branch names now, and
  the launch says so when the branch has moved since (``moved_note``);
- whatever the store (a local directory, another mirror), every planned shard the record names must
  carry the same SHA-256 in the store's manifests, or the launch is refused naming a file
  (``check_same_bytes``, ``CorpusChanged``): other bytes under the same names are another corpus.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from ds_trhash.data.stream.store import LOCAL_COMMIT, ShardStore, StoreError

_SHOWN = 3


class CorpusChanged(StoreError):
    """The store holds other bytes under the names a run's earlier stage or launch read."""


def pinned_commit(saved: Optional[Mapping[str, Any]], store: ShardStore) -> Optional[str]:
    """The commit to read: the recorded one when the record is of this very store (a mirror or a
    local copy has commits of its own, and is held to the recorded bytes instead)."""
    if not saved or saved.get("store") != store.identity:
        return None
    commit = saved.get("commit")
    return commit if isinstance(commit, str) and commit and commit != LOCAL_COMMIT else None


def moved_note(saved: Optional[Mapping[str, Any]], store: ShardStore, commit: str, who: str) -> Optional[str]:
    """What to say when the branch the record asked for now names another commit (one request)."""
    revision = (saved or {}).get("revision")
    head = getattr(store, "head", None)
    if not revision or head is None or revision == commit:
        return None
    now = head(revision)
    if now is None or now == commit:
        return None
    return (f"{revision!r} of {store.identity} has moved to {now[:12]} since {who} read it; reading commit "
            f"{commit[:12]}, the corpus {who} trained on (to train on the new commit, start a new run)")


def check_same_bytes(saved: Optional[Mapping[str, Any]], record: Mapping[str, Any], who: str, fix: str) -> None:
    """Every planned shard that ``saved`` names has the same SHA-256 in ``record`` (this launch's
    corpus); raises ``CorpusChanged`` naming the first files that differ."""
    before = (saved or {}).get("shards")
    if not isinstance(before, Mapping):
        return  # a record from before shard hashes were kept: the commit (if any) is all there is
    now = record.get("shards") or {}
    differ = [f"{path} has sha256 {now[path][:12]}… now, {str(digest)[:12]}… when {who} read it"
              for path, digest in sorted(before.items()) if path in now and now[path] != digest]
    if differ:
        more = f" (and {len(differ) - _SHOWN} more)" if len(differ) > _SHOWN else ""
        raise CorpusChanged(f"the corpus at {record.get('store')} is not the one {who} read: "
                          f"{'; '.join(differ[:_SHOWN])}{more}; {fix}")
