"""One shard's tokens, memory-mapped once: what the node cache hands a reader that holds an entry
(``cache.ShardCache.hold_shard``), and what a reader maps itself from a shard directory without
a cache. Both sides use it, so it sits above the rooms. Rows are copied out of the map
(``read_into``); ``release`` unmaps it and gives back whatever held the entry.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ds_trhash.data.formats.shards import TOKEN_DTYPE, ShardError
from ds_trhash.data.stream.types import Key


class MappedShard:
    """One shard's tokens, mapped once; ``release`` closes the map and whatever held the entry."""

    def __init__(self, key: Key, path: Path, seq_len: int, on_release: Optional[Callable[[], None]] = None) -> None:
        self.key, self.where, self.seq_len = key, str(path), seq_len
        self._on_release = on_release
        # a plain array over the map: indexing a memmap object costs more than reading the rows
        tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r").view(np.ndarray)
        self.tokens: Optional[np.ndarray] = tokens
        if len(tokens) < seq_len + 1 or (len(tokens) - 1) % seq_len:
            count = len(tokens)
            del tokens
            self.release()
            raise ShardError(f"{path} holds {count} tokens, not rows·{seq_len}+1; wrong seq_len or damaged shard")
        self.rows = (len(tokens) - 1) // seq_len
        self.size = int(tokens.nbytes)

    def read_into(self, out: np.ndarray, positions: Sequence[int], rows: Sequence[int]) -> None:
        """``out[positions[i]]`` = the window of row ``rows[i]`` (int64, seq_len + 1 tokens); a
        slice per row (a micro-batch takes a few rows of each shard: faster than one gather)."""
        tokens, length = self.tokens, self.seq_len
        if tokens is None:
            raise ShardError(f"{self.where} was read after its release")
        for position, row in zip(positions, rows):
            if not 0 <= row < self.rows:
                raise ShardError(f"row {row} is outside {self.where}, which has {self.rows} rows")
            out[position] = tokens[row * length: row * length + length + 1]

    def release(self) -> None:
        self.tokens = None  # the only reference to the map (rows are copied out): unmapped now
        if self._on_release is not None:
            release, self._on_release = self._on_release, None
            release()
