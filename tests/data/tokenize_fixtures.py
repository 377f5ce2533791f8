"""A small corpus in every input format, its tokenizer, and `data tokenize` run in-process."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ds_trhash.cli import main
from ds_trhash.data.formats.tokenizer import load_tokenizer, train_tokenizer

WORDS = ("hash routed experts replay plans never repeat data silently tokens shards manifests stream rows "
         "parquet streaming workers chunks resume").split()
SEQ_LEN, ROWS = 16, 4


def text(i: int) -> str:
    """Document i: deterministic, of varied length (1 to 40 words)."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(1 + (i * 13) % 40))


@pytest.fixture(scope="session")
def corpus_tok(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus_tok")
    train_tokenizer([text(i) for i in range(200)], 400, out)
    return out


def write_inputs(root: Path, n: int = 240) -> list[Path]:
    """n documents over four files: plain text, JSONL, JSONL.gz and Parquet (in that order)."""
    root.mkdir(parents=True, exist_ok=True)
    quarter = n // 4
    docs = [text(i) for i in range(n)]
    plain = root / "a.txt"
    plain.write_text("\n\n".join(docs[:quarter]) + "\n", encoding="utf-8")
    jsonl = root / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[quarter:2 * quarter]), encoding="utf-8")
    packed = root / "c.jsonl.gz"
    packed.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[2 * quarter:3 * quarter]).encode()))
    table = root / "d.parquet"
    pq.write_table(pa.table({"text": docs[3 * quarter:]}), table, row_group_size=17)
    return [plain, jsonl, packed, table]


def expected_stream(tok_dir: Path, docs) -> np.ndarray:
    tok = load_tokenizer(tok_dir)
    return np.concatenate([tok.encode(d, add_special_tokens=False).ids + [0] for d in docs])


def stored_stream(source_dir: Path) -> np.ndarray:
    """The source's token stream read back from its shards (the shared boundary token once)."""
    manifest = json.loads((source_dir / "manifest.json").read_text())
    parts = [np.fromfile(source_dir / s["file"], dtype="<u2")[(1 if k else 0):] for k, s in enumerate(manifest["shards"])]
    return np.concatenate(parts)


def tokenize(capsys, inputs, out, tok, *extra, source="web"):
    """`ds-trhash data tokenize` in-process: (exit code, stdout, stderr)."""
    argv = ["data", "tokenize", "--input", *map(str, inputs), "--source", source, "--tokenizer", str(tok),
            "--seq-len", str(SEQ_LEN), "--rows-per-shard", str(ROWS), "--vocab-size", "400", "--out", str(out),
            "--chunk-records", "16", *map(str, extra)]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
