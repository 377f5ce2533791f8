"""A stand-in for the release corpus's manifests (docs/contracts.md §2b), reconstructed from the
released plans' file lists, for the plan builders' tests. No shard file exists: the builders read
manifests only, and a test that passes here proves it.

What is reconstructed and what is not: every shard a released plan names (the unique core's and
the corrected plan's backfill shards) is listed with the release's full shard size of 976,562
rows of 1,024 tokens, in file-name order. What the public files do not say is how many more
shards each source holds past the last one a plan names, and how many rows its last shard has;
here each source gets one more, shorter shard (SHORT_TAIL_ROWS rows, a made-up count), which no
builder reaches with the release's numbers. SHA-256 values are made up (the builders never read
them).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

RELEASED = Path(__file__).resolve().parent / "plans" / "release_plans"
REPLAY, CORRECTED, PHASE2 = ("tr_hash_70b_quality_replay.json", "tr_hash_70b_quality_replay_corrected.json",
                             "tr_hash_70b_unique_only_phase2.json")
SEQ_LEN = 1024
FULL_ROWS = 976_562  # 10^9 tokens a shard
SHORT_TAIL_ROWS = 123_457
DATASET, REVISION = "hf://datasets/Pacific-i64/data-32k-200b-tokens", "main"
# The release's budgets (10^9 tokens) and passes, in the plan's source order (docs/contracts.md §2c).
BUDGETS = {"dclm": 20, "fineweb_edu_dedup": 25, "stack_edu": 8, "finemath": 5, "infiwebmath": 5, "cosmopedia_v2": 7}
PASSES = {"dclm": 1, "fineweb_edu_dedup": 2, "stack_edu": 2, "finemath": 3, "infiwebmath": 3, "cosmopedia_v2": 2}
DOUBLE_EXPOSED = {"dclm": 0, "fineweb_edu_dedup": 9, "stack_edu": 3, "finemath": 1, "infiwebmath": 1, "cosmopedia_v2": 2}


def named_files() -> dict[str, set[str]]:
    """Every shard file any released plan names, by source."""
    files: dict[str, set[str]] = {}
    for name in (REPLAY, CORRECTED, PHASE2):
        for phase in json.loads((RELEASED / name).read_text())["phases"]:
            for source, entries in phase["sources"].items():
                files.setdefault(source, set()).update(entry["file"] for entry in entries)
    return files


def write_release_layout(root: Path, shard_rows: dict[str, list[int]], seq_len: int = SEQ_LEN) -> Path:
    """mixture_manifest.json + corpora/<source>/manifest.json for shards tokens-00000.bin, ... of the
    given row counts (no shard files). Returns ``root``."""
    root = Path(root)
    entries = []
    for source, rows_list in shard_rows.items():
        shards = [{"file": f"tokens-{i:05d}.bin", "rows": rows, "tokens": rows * seq_len + 1,
                   "bytes": 2 * (rows * seq_len + 1),
                   "sha256": hashlib.sha256(f"{source}/{i}".encode()).hexdigest()} for i, rows in enumerate(rows_list)]
        rows = sum(rows_list)
        manifest = {"format": "tr-hash-token-mixture-v1", "source": source, "weight": 1.0, "seq_len": seq_len,
                    "dtype": "uint16", "rows": rows, "trained_tokens": rows * seq_len,
                    "source_tokens_consumed": rows * seq_len, "shards": shards}
        path = root / "corpora" / source / "manifest.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest, indent=2))
        entries.append({"name": source, "weight": 1.0, "rows": rows, "trained_tokens": rows * seq_len,
                        "manifest": f"corpora/{source}/manifest.json"})
    total = sum(entry["trained_tokens"] for entry in entries)
    mixture = {"format": "tr-hash-token-mixture-v1", "dtype": "uint16", "seq_len": seq_len, "requested_tokens": total,
               "actual_tokens": total, "global_batch_sequences": 768, "sources": entries}
    (root / "mixture_manifest.json").write_text(json.dumps(mixture, indent=2))
    return root


def write_release_corpus(root: Path) -> Path:
    """The release corpus's manifests as reconstructed above (source order: the plan's)."""
    files = named_files()
    layout = {}
    for source in BUDGETS:
        numbers = sorted(int(name[len("tokens-"):-len(".bin")]) for name in files[source])
        assert numbers == list(range(len(numbers))), f"{source}: the plans skip a shard number"
        layout[source] = [FULL_ROWS] * len(numbers) + [SHORT_TAIL_ROWS]
    return write_release_layout(root, layout)
