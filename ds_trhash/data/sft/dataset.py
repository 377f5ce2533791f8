"""Open a built SFT set fail-closed, pack it into windows, and serve per-rank batches.

`open_sft` runs before any model exists: a set that was modified, built for another
tokenizer or vocabulary, or that holds an example which cannot fit a window is refused
with a message naming the file and field, instead of surfacing later as a silent loss
change. Every check reads only the set itself.

The order of packs in an epoch is a pure function of (seed, epoch) (docs/contracts.md §4 "Here"), so
a run resumed at (epoch e, batch k) sees exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ds_trhash.data.sft.chat import CHAT_TEMPLATE_ID, EOS_ID, EOS_TOKEN, PAD_ID, SUPERVISION_MODES
from ds_trhash.batch_layout import step_rows
from ds_trhash.errors import UserError
from ds_trhash.safe_names import UnsafeNameError, resolve_under
from ds_trhash.model.loss import IGNORE_INDEX
from ds_trhash.io import sha256_file
from ds_trhash.data.sft.build import (
    INDEX_FORMAT,
    INPUT_DTYPE,
    LABEL_DTYPE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    PARTITION_FILES,
    PARTITIONS,
    TOKENIZER_FILE,
)

POLICIES = ("cross_document", "per_document")
REBUILD = "rebuild the set with `ds-trhash sft build`"
_CHECK_CHUNK_TOKENS = 1 << 24  # bounds the memory of the token checks on large sets


class SFTDataError(UserError, ValueError):
    """The SFT set cannot be used as configured; the message names the file/field and the fix."""


@dataclass(frozen=True)
class ExampleRef:
    index: int
    example_id: str
    offset: int
    num_tokens: int
    supervised_tokens: int
    source: str
    capability: str


@dataclass(frozen=True, eq=False)  # holds memmaps: identity, not value, equality
class SFTPartition:
    name: str
    input_ids: np.ndarray = field(repr=False)  # memmap, <u4
    labels: np.ndarray = field(repr=False)  # memmap, <i4
    examples: tuple[ExampleRef, ...] = field(repr=False)

    def __len__(self) -> int:
        return len(self.examples)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ref = self.examples[i]
        span = slice(ref.offset, ref.offset + ref.num_tokens)
        return self.input_ids[span], self.labels[span]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.examples)

    @property
    def supervised_tokens(self) -> int:
        return sum(e.supervised_tokens for e in self.examples)


@dataclass(frozen=True, eq=False)  # holds memmaps: identity, not value, equality
class SFTData:
    root: Path
    manifest: dict = field(repr=False)
    partitions: dict[str, SFTPartition] = field(repr=False)

    def partition(self, name: str) -> SFTPartition:
        if name not in self.partitions:
            raise SFTDataError(f"unknown SFT partition {name!r}; available: {', '.join(self.partitions)}")
        return self.partitions[name]

    @property
    def tokenizer_hash(self) -> str:
        return self.manifest["tokenizer"]["sha256"]

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise SFTDataError(f"{path} is missing; the SFT set is incomplete: {REBUILD}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SFTDataError(f"{path} is not valid JSON ({err}); {REBUILD}") from None
    if not isinstance(doc, dict):
        raise SFTDataError(f"{path} must hold a JSON object ({what}); {REBUILD}")
    return doc


def _expect(actual: object, expected: object, where: str, fix: str) -> None:
    if actual != expected:
        raise SFTDataError(f"{where} is {actual!r}, expected {expected!r}; {fix}")


def _check_manifest(root: Path, manifest: dict, expect_vocab: int, tokenizer_hash: str | None) -> None:
    where = f"{root / MANIFEST_FILE}"
    _expect(manifest.get("format"), MANIFEST_FORMAT, f"{where} field 'format'", REBUILD)
    _expect(manifest.get("chat_template"), CHAT_TEMPLATE_ID, f"{where} field 'chat_template'", REBUILD)
    if manifest.get("supervision") not in SUPERVISION_MODES:
        raise SFTDataError(f"{where} field 'supervision' is {manifest.get('supervision')!r}; allowed: {', '.join(SUPERVISION_MODES)}")
    _expect(manifest.get("eos"), {"token": EOS_TOKEN, "id": EOS_ID}, f"{where} field 'eos'", "the set was built with another tokenizer layout; " + REBUILD)
    _expect(manifest.get("vocab_size"), expect_vocab, f"{where} field 'vocab_size'",
            "the set was built for another vocabulary; rebuild it with the model's tokenizer")
    if tokenizer_hash is not None:
        _expect(manifest.get("tokenizer", {}).get("sha256"), tokenizer_hash, f"{where} field 'tokenizer.sha256'",
                "the set was tokenized with a different tokenizer than the model's; rebuild it with the model's tokenizer")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise SFTDataError(f"{where} has no 'files' table of SHA-256 hashes; {REBUILD}")
    required = [TOKENIZER_FILE] + [f"{p}/{f}" for p in PARTITIONS for f in PARTITION_FILES]
    unlisted = [name for name in required if name not in files]
    if unlisted:
        raise SFTDataError(f"{where} does not list {', '.join(unlisted)}; {REBUILD}")
    for name, digest in files.items():
        try:  # a name from the manifest never leads out of the set's folder (docs/contracts.md §2d)
            path = resolve_under(root, name, where, f"files.{name}")
        except UnsafeNameError as exc:
            raise SFTDataError(f"{exc}; {REBUILD}") from None
        if not path.is_file():
            raise SFTDataError(f"{path} is listed in the manifest but missing; the set is incomplete: {REBUILD}")
        if sha256_file(path) != digest:
            raise SFTDataError(f"{path}: SHA-256 does not match the manifest; the file was modified after the build: {REBUILD}")


def _load_index(path: Path) -> tuple[ExampleRef, ...]:
    refs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            try:
                e = json.loads(line)
                refs.append(ExampleRef(i, str(e["example_id"]), int(e["offset"]), int(e["num_tokens"]),
                                       int(e["supervised_tokens"]), str(e["source"]), str(e["capability"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise SFTDataError(f"{path}:{i + 1}: unreadable example entry ({err!r}); {REBUILD}") from None
    return tuple(refs)


def _check_index(part_dir: Path, idx: dict, summary: dict, refs: tuple[ExampleRef, ...], vocab: int, seq_len: int) -> None:
    where = str(part_dir / "sft.idx.json")
    _expect(idx.get("format"), INDEX_FORMAT, f"{where} field 'format'", REBUILD)
    _expect(idx.get("eos_token_id"), EOS_ID, f"{where} field 'eos_token_id'", REBUILD)
    _expect(idx.get("vocab_size"), vocab, f"{where} field 'vocab_size'", REBUILD)
    _expect(idx.get("chat_template"), CHAT_TEMPLATE_ID, f"{where} field 'chat_template'", REBUILD)
    counts = {"examples": len(refs), "num_tokens": sum(r.num_tokens for r in refs),
              "supervised_tokens": sum(r.supervised_tokens for r in refs)}
    for key, actual in counts.items():
        _expect(idx.get(key), actual, f"{where} field {key!r} (examples.jsonl holds {actual})", REBUILD)
        _expect(summary.get(key), actual, f"manifest partitions.{part_dir.name}.{key}", REBUILD)
    if not refs:
        raise SFTDataError(f"{part_dir}/examples.jsonl holds no example; an SFT partition needs at least one: {REBUILD}")
    offset = 0
    for r in refs:
        if r.offset != offset or r.num_tokens < 1:
            raise SFTDataError(f"{part_dir}/examples.jsonl:{r.index + 1}: offset {r.offset} / num_tokens {r.num_tokens} do not continue the previous example (expected offset {offset}); {REBUILD}")
        if r.supervised_tokens < 1:
            raise SFTDataError(f"{part_dir}/examples.jsonl:{r.index + 1} ({r.example_id}) supervises no token; every example must supervise its final assistant turn: {REBUILD}")
        if r.num_tokens > seq_len:
            raise SFTDataError(f"{part_dir}/examples.jsonl:{r.index + 1} ({r.example_id}) has {r.num_tokens} tokens, more than the configured seq_len {seq_len}; examples are never truncated: raise seq_len or rebuild with --seq-len {seq_len}")
        offset += r.num_tokens
    for name, dtype in (("input_ids.bin", INPUT_DTYPE), ("labels.bin", LABEL_DTYPE)):
        size = (part_dir / name).stat().st_size
        _expect(size, offset * np.dtype(dtype).itemsize, f"size of {part_dir / name}", REBUILD)


def _example_chunks(refs: tuple[ExampleRef, ...]) -> Iterator[tuple[ExampleRef, ...]]:
    start, tokens = 0, 0
    for i, r in enumerate(refs):
        if tokens and tokens + r.num_tokens > _CHECK_CHUNK_TOKENS:
            yield refs[start:i]
            start, tokens = i, 0
        tokens += r.num_tokens
    yield refs[start:]


def _check_tokens(part_dir: Path, part: SFTPartition, vocab: int) -> None:
    """Token ranges, per-example supervision and the pre-shift invariant, chunk by chunk."""
    for chunk in _example_chunks(part.examples):
        base = chunk[0].offset
        ids = np.asarray(part.input_ids[base:chunk[-1].offset + chunk[-1].num_tokens], dtype=np.int64)
        labels = np.asarray(part.labels[base:base + len(ids)], dtype=np.int64)
        starts = np.array([r.offset - base for r in chunk])
        ends = starts + np.array([r.num_tokens for r in chunk]) - 1
        supervised = labels != IGNORE_INDEX
        is_end = np.zeros(len(ids), dtype=bool)
        is_end[ends] = True
        problems = {
            f"input id outside [0, {vocab})": ids >= vocab,
            f"label outside [0, {vocab}) and not {IGNORE_INDEX}": supervised & ((labels < 0) | (labels >= vocab)),
            "supervised label differs from the next input id (not pre-shifted)":
                supervised & ~is_end & (labels != np.append(ids[1:], -1)),
            f"final label of an example is not the supervised EOS {EOS_ID}": is_end & (labels != EOS_ID),
        }
        for what, bad in problems.items():
            if bad.any():
                pos = int(np.argmax(bad))
                ref = chunk[int(np.searchsorted(starts, pos, side="right")) - 1]
                raise SFTDataError(f"{part_dir.name}/ token {base + pos} in example {ref.example_id}: {what}; {REBUILD}")
        counted = np.add.reduceat(supervised.astype(np.int64), starts)
        for ref, count in zip(chunk, counted.tolist()):
            if count != ref.supervised_tokens:
                raise SFTDataError(f"{part_dir}/examples.jsonl:{ref.index + 1} says {ref.supervised_tokens} supervised tokens, labels.bin holds {count}; {REBUILD}")


def open_sft(root: str | os.PathLike, expect_vocab: int, seq_len: int, tokenizer_hash: str | None = None) -> SFTData:
    """Verify a built SFT set against the run's vocabulary, window and tokenizer, then map it."""
    root = Path(root)
    manifest = _read_json(root / MANIFEST_FILE, "the SFT manifest")
    _check_manifest(root, manifest, expect_vocab, tokenizer_hash)
    partitions = {}
    for name in PARTITIONS:
        part_dir = root / name
        refs = _load_index(part_dir / "examples.jsonl")
        summary = manifest.get("partitions", {}).get(name, {})
        _check_index(part_dir, _read_json(part_dir / "sft.idx.json", "the partition index"), summary, refs, expect_vocab, seq_len)
        part = SFTPartition(name, np.memmap(part_dir / "input_ids.bin", dtype=INPUT_DTYPE, mode="r"),
                            np.memmap(part_dir / "labels.bin", dtype=LABEL_DTYPE, mode="r"), refs)
        _check_tokens(part_dir, part, expect_vocab)
        partitions[name] = part
    return SFTData(root, manifest, partitions)


@dataclass(frozen=True)
class Pack:
    """Whole examples laid out in one window; arrays are built on demand from the memmap.

    An empty `examples` tuple is an all-padding window (fills the last batch when not
    dropping it); it supervises nothing.
    """

    examples: tuple[int, ...]
    seq_len: int
    policy: str
    partition: SFTPartition = field(repr=False, compare=False)

    @property
    def supervised_tokens(self) -> int:
        return sum(self.partition.examples[i].supervised_tokens for i in self.examples)

    @property
    def used_tokens(self) -> int:
        """Example tokens plus one separator between consecutive examples."""
        return sum(self.partition.examples[i].num_tokens for i in self.examples) + max(0, len(self.examples) - 1)

    def arrays(self) -> dict[str, np.ndarray]:
        """input_ids, labels, position_ids, document_ids as int64 [seq_len].

        Separators (input EOS, label -100) belong to the document before them; padding
        (input <pad>, label -100) is its own document, so under per_document masking
        nothing leaks between examples.
        """
        T = self.seq_len
        out = {"input_ids": np.full(T, PAD_ID, np.int64), "labels": np.full(T, IGNORE_INDEX, np.int64),
               "position_ids": np.zeros(T, np.int64), "document_ids": np.zeros(T, np.int64)}
        cursor = 0
        for doc, i in enumerate(self.examples):
            ids, labels = self.partition.example(i)
            n = len(ids)
            if doc:
                out["input_ids"][cursor] = EOS_ID
                out["position_ids"][cursor] = out["position_ids"][cursor - 1] + 1
                out["document_ids"][cursor] = doc - 1
                cursor += 1
            out["input_ids"][cursor:cursor + n] = ids
            out["labels"][cursor:cursor + n] = labels
            out["position_ids"][cursor:cursor + n] = np.arange(n)
            out["document_ids"][cursor:cursor + n] = doc
            cursor += n
        out["position_ids"][cursor:] = np.arange(T - cursor)
        out["document_ids"][cursor:] = len(self.examples)
        if self.policy == "cross_document":
            out["position_ids"] = np.arange(T, dtype=np.int64)
            out["document_ids"][:] = 0
        return out


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise SFTDataError(f"unknown packing policy {policy!r}; allowed: {', '.join(POLICIES)}")
    return policy


def pack(partition: SFTPartition, seq_len: int, policy: str) -> list[Pack]:
    """Next-fit, in stored order: an example goes into the open window if it fits after one
    separator, else it opens a new window. Examples are never split."""
    check_policy(policy)
    packs: list[Pack] = []
    current: list[int] = []
    used = 0
    for ref in partition.examples:
        if ref.num_tokens > seq_len:
            raise SFTDataError(f"example {ref.example_id} has {ref.num_tokens} tokens and cannot fit a {seq_len}-token window; examples are never split")
        if current and used + 1 + ref.num_tokens <= seq_len:
            current.append(ref.index)
            used += 1 + ref.num_tokens
            continue
        if current:
            packs.append(Pack(tuple(current), seq_len, policy, partition))
        current, used = [ref.index], ref.num_tokens
    if current:
        packs.append(Pack(tuple(current), seq_len, policy, partition))
    return packs


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The pack order of one epoch, from (seed, epoch) alone: never derived from the previous
    epoch's order, so any epoch can be reproduced on resume without replaying earlier ones."""
    if seed < 0 or epoch < 0 or n < 0:
        raise ValueError(f"seed, epoch and n must be non-negative, got seed={seed}, epoch={epoch}, n={n}")
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n).tolist()


class SFTBatches:
    """Per-rank micro-batches of packs for every epoch.

    Global batch b of an epoch is the slots [b·G, (b+1)·G) of the epoch order, with
    G = micro_batch · world_size; rank r takes the r-th block of micro_batch slots, so ranks
    read disjoint packs and all ranks have the same number of batches. With drop_last the
    epoch is truncated to a multiple of G packs (the dropped packs differ per epoch, since
    the order does); without it the last global batch is completed with all-padding windows
    that supervise nothing (use for held-out evaluation, which must see every pack).
    """

    def __init__(self, packs: list[Pack], micro_batch: int, world_size: int, rank: int, seed: int, drop_last: bool = True):
        if not packs:
            raise SFTDataError("no packs to batch; the SFT partition is empty")
        if micro_batch < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need micro_batch >= 1, world_size >= 1 and 0 <= rank < world_size; got {micro_batch}, {world_size}, {rank}")
        if len({(p.seq_len, p.policy) for p in packs}) != 1:
            raise SFTDataError("packs mix window lengths or packing policies; pack one partition with one seq_len and policy")
        self.packs, self.micro_batch, self.world_size, self.rank, self.seed = packs, micro_batch, world_size, rank, seed
        self.global_batch = step_rows(micro_batch, 1, world_size)  # one micro-batch on every rank
        slots = len(packs) // self.global_batch if drop_last else math.ceil(len(packs) / self.global_batch)
        if slots == 0:
            raise SFTDataError(f"{len(packs)} packs make no full global batch of micro_batch {micro_batch} x world_size {world_size}; "
                               "lower the micro batch, or add data")
        self.batches_per_epoch = slots
        self._filler = Pack((), packs[0].seq_len, packs[0].policy, packs[0].partition)
        self._order = lru_cache(maxsize=2)(lambda epoch: epoch_order(seed, epoch, len(packs)))

    def pack_indices(self, epoch: int, index: int, rank: int | None = None) -> list[int | None]:
        """Pack indices of one rank's micro-batch; None marks an all-padding filler window."""
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"batch {index} is outside epoch of {self.batches_per_epoch} batches")
        order = self._order(epoch)
        start = index * self.global_batch + (self.rank if rank is None else rank) * self.micro_batch
        return [order[s] if s < len(order) else None for s in range(start, start + self.micro_batch)]

    def _packs(self, epoch: int, index: int, rank: int | None = None) -> list[Pack]:
        return [self._filler if i is None else self.packs[i] for i in self.pack_indices(epoch, index, rank)]

    def batch(self, epoch: int, index: int) -> dict[str, torch.Tensor]:
        rows = [p.arrays() for p in self._packs(epoch, index)]
        return {key: torch.from_numpy(np.stack([r[key] for r in rows])) for key in rows[0]}

    def supervised_tokens(self, epoch: int, index: int, all_ranks: bool = False) -> int:
        """This rank's supervised tokens in batch `index`, or those of all ranks (the
        denominator of a sum-reduced loss over one global batch, known without a collective)."""
        ranks = range(self.world_size) if all_ranks else [self.rank]
        return sum(p.supervised_tokens for r in ranks for p in self._packs(epoch, index, r))

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        for index in range(start, self.batches_per_epoch):
            yield self.batch(epoch, index)
