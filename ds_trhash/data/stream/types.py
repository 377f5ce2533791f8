"""The names the stream's modules share, declared once.

A ``Key`` names one shard of a corpus: ``(source, file)``, the source's name in the plan and the
shard's file name under that source (as a plan's segments list them). The cache, its fetcher,
the working set, the reader, the horizon, the row exchange and the corpus checks all key their
shards this way, so a key made by one is found by the others.
"""
from __future__ import annotations

Key = tuple[str, str]
