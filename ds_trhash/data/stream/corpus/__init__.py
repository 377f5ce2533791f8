"""The corpus a launch reads, settled before training starts.

* ``opening`` - the one question a launch asks: can this plan be read from this store, and how
  (``open_corpus``, ``shared_corpus``: the commit, one listing, the manifests against the plan);
* ``pinning`` - one corpus from pretraining on: the commit and bytes a run first read stay its
  corpus on resume and in refinement.

Imports ``store``, ``cache`` (the bound, for the cache check) and ``formats`` / ``plans``.
"""
from ds_trhash.data.stream.corpus.opening import (PREFETCH_SHARDS, Corpus, CorpusError, check_plan_manifests,
                                                  open_corpus, resume_commit, shared_corpus)
from ds_trhash.data.stream.corpus.pinning import CorpusChanged, check_same_bytes, moved_note, pinned_commit

__all__ = ["PREFETCH_SHARDS", "Corpus", "CorpusChanged", "CorpusError", "check_plan_manifests", "check_same_bytes",
           "moved_note", "open_corpus", "pinned_commit", "resume_commit", "shared_corpus"]
