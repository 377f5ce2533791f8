"""Small synthetic corpora for the layout tests: ours (``write_shards``) and the release's
(``mixture_manifest.json`` + ``corpora/<source>/manifest.json`` + ``tokens-NNNNN.bin``), with
real shard bytes and SHA-256s."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ds_trhash.data.formats.shards import load_manifests, write_shards

L = 8


def our_corpus(root: Path, sources=("alpha", "beta"), docs=3, tokens=40, seq_len=L, rows_per_shard=2,
               vocab_size=1000, tokenizer_hash="t" * 64, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    for source in sources:
        documents = [np.append(rng.integers(1, vocab_size, tokens), 0) for _ in range(docs)]
        write_shards(source, documents, seq_len, rows_per_shard, root, vocab_size, tokenizer_hash)
    return root


def release_copy(ours: Path, root: Path, rename=lambda i: f"tokens-{i:05d}.bin") -> Path:
    """The same shard bytes in the release's layout, its manifests holding the release's fields only."""
    manifests = load_manifests([ours])
    seq_len = next(iter(manifests.values())).seq_len
    mixture_sources = []
    for name, m in manifests.items():
        folder = root / "corpora" / name
        folder.mkdir(parents=True)
        shards = []
        for i, shard in enumerate(m.shards):
            data = (ours / name / shard.file).read_bytes()
            (folder / rename(i)).write_bytes(data)
            shards.append({"file": rename(i), "rows": shard.rows, "tokens": shard.tokens, "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
        (folder / "manifest.json").write_text(json.dumps({
            "format": "tr-hash-token-mixture-v1", "source": name, "weight": 0.5, "seq_len": seq_len,
            "dtype": "uint16", "rows": m.rows, "trained_tokens": m.rows * seq_len,
            "source_tokens_consumed": m.rows * seq_len + 1, "shards": shards}, indent=1))
        mixture_sources.append({"name": name, "weight": 0.5, "rows": m.rows, "trained_tokens": m.rows * seq_len,
                                "manifest": f"corpora/{name}/manifest.json"})
    total = sum(s["trained_tokens"] for s in mixture_sources)
    (root / "mixture_manifest.json").write_text(json.dumps({
        "format": "tr-hash-token-mixture-v1", "dtype": "uint16", "seq_len": seq_len, "requested_tokens": total,
        "actual_tokens": total, "global_batch_sequences": 8, "sources": mixture_sources}, indent=1))
    return root


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
