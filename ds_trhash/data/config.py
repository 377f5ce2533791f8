"""The ``data:`` section of a stage config, declared by the data package that reads it (its
rooms take it from here; it imports nothing heavy, so loading a config stays light).

``training/config`` composes it into ``TrainConfig`` (the YAML keys are these field names); the
checks of its values come from ``ds_trhash.config_fields``. Key reference: ``docs/configs.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ds_trhash.config_fields import non_negative, optional, positive, setting


@dataclass(frozen=True)
class PackingSection:
    policy: Literal["cross_document", "per_document"] = "cross_document"


@dataclass(frozen=True)
class DataSection:
    kind: Literal["pretrain", "sft"] = "pretrain"
    plan: str | None = None
    shards_dir: str | None = None
    cache_dir: str | None = None
    cache_gb: float = setting(1.0, check=positive)
    # How long a Hub store waits out an outage (503s, 429s, no connection) before the run stops with
    # a checkpoint: each wait is one line, Retry-After and rate limits are honoured.
    hub_wait_minutes: float = setting(30.0, check=positive)
    # How far ahead, in time at the measured pace, the cache fetches the shards the plan reads next
    # (two at a time per rank, held until read); 0 looks only at the next shuffle window.
    prefetch_minutes: float = setting(10.0, check=non_negative)
    # On several nodes reading the Hub: the global rows whose exchange between the nodes is one
    # collective (rounded down to whole steps, at least one step).
    exchange_rows: int = setting(4096, check=positive)
    # A cache folder on a network filesystem (nfs, lustre, gpfs, cifs, fuse) is refused unless this
    # says its locks work and only one node uses it.
    cache_on_network_fs: bool = False
    sft_dir: str | None = None
    tokenizer: str | None = None
    seq_len: int = setting(2048, check=positive)
    packing: PackingSection = setting(factory=PackingSection)
    target_tokens: int | None = setting(None, check=optional(positive))
