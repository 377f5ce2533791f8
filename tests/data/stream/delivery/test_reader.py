import json
import time
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.plans.plan import derive_refinement
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.stream.delivery.reader import _LOOKAHEAD_MICRO_BATCHES, ReaderError, ReplayReader
from ds_trhash.data.stream.corpus import CorpusError, check_plan_manifests, open_corpus
from ds_trhash.data.formats.shards import load_manifests, read_rows, write_shards
from ds_trhash.data.stream.mapped_shard import MappedShard

L, R = 4, 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Source a: 23 rows (shards 5,5,5,5,3), b: 12 rows (5,5,2); every token is unique."""
    root = tmp_path_factory.mktemp("shards")
    write_shards("a", [np.arange(1, 1 + 23 * L + 1)], L, R, root, vocab_size=30000, tokenizer_hash="h")
    write_shards("b", [np.arange(20000, 20000 + 12 * L + 1)], L, R, root, vocab_size=30000, tokenizer_hash="h")
    manifests = load_manifests([root])
    doc = build_plan(manifests, 35 * L, dataset="t", revision="1", source_passes={"a": 2})
    return root, doc


def synthetic_plan(rows_by_source, passes=None, shard_rows=None):
    manifests = {}
    for source, rows in rows_by_source.items():
        per = shard_rows or rows
        sizes = [per] * (rows // per) + ([rows % per] if rows % per else [])
        manifests[source] = {"source": source, "seq_len": L, "vocab_size": 9, "tokenizer_sha256": "h",
                             "shards": [{"file": f"s{i}.bin", "rows": r} for i, r in enumerate(sizes)]}
    return build_plan(manifests, sum(rows_by_source.values()) * L, dataset="t", revision="1", source_passes=passes)


def greedy_wfq(rows_by_source):
    """docs/contracts.md §2 read literally: next row from the source with the smallest served/weight, ties by name."""
    served = dict.fromkeys(rows_by_source, 0)
    order = []
    for _ in range(sum(rows_by_source.values())):
        live = [s for s in sorted(served) if served[s] < rows_by_source[s]]
        pick = min(live, key=lambda s: (Fraction(served[s], rows_by_source[s]), s))
        order.append(pick)
        served[pick] += 1
    return order


@pytest.mark.parametrize("rows", [{"a": 23, "b": 12}, {"x": 3, "y": 3, "z": 3}, {"p": 7, "q": 1, "r": 13, "s": 6}])
def test_unshuffled_order_is_weighted_fair_queuing(rows):
    reader = ReplayReader(synthetic_plan(rows, shard_rows=4), "unused", seed=0, shuffle_window=0)
    refs = reader.global_rows(0, reader.num_rows)
    assert [source for source, _, _ in refs] == greedy_wfq(rows)
    for source in rows:  # each source's rows come in shard order, row order
        mine = [(int(file[1:-4]), row) for s, file, row in refs if s == source]
        assert mine == sorted(mine) and len(mine) == rows[source]


def test_order_covers_every_phase_row_once_per_pass(corpus):
    _, doc = corpus
    reader = ReplayReader(doc, "unused", seed=3, shuffle_window=8)
    assert reader.num_rows == 23 * 2 + 12
    refs = reader.global_rows(0, reader.num_rows)
    assert len(set(refs[:35])) == 35  # the unique core: every row once
    assert Counter(r for r in refs if r[0] == "a") == Counter({r: 2 for r in refs[:35] if r[0] == "a"})
    assert reader.phase_at(34) == "unique_core" and reader.phase_at(35) == "quality_replay_2"
    assert reader.global_rows(10, 7) == refs[10:17]


def test_order_is_a_pure_function_of_plan_and_seed(corpus):
    _, doc = corpus
    first = ReplayReader(doc, "unused", seed=7, shuffle_window=8).global_rows(0, 58)
    assert ReplayReader(doc, "unused", seed=7, shuffle_window=8).global_rows(0, 58) == first
    assert ReplayReader(doc, "unused", seed=8, shuffle_window=8).global_rows(0, 58) != first
    plain = ReplayReader(doc, "unused", seed=7, shuffle_window=0).global_rows(0, 58)
    for start in range(0, 35, 8):  # shuffling stays inside each window of the segment
        end = min(start + 8, 35)
        assert set(first[start:end]) == set(plain[start:end])
    assert first[:35] != plain[:35]


def _step_rows(reader, step, world_size, micro_batch, grad_accum):
    rows = []
    for rank in range(world_size):
        layout = BatchLayout(micro_batch=micro_batch, grad_accum=grad_accum, rank=rank, world_size=world_size)
        for micro in range(grad_accum):
            inputs, labels = reader.batch(step, micro, layout)
            assert inputs.shape == labels.shape == (micro_batch, L) and inputs.dtype == torch.int64
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            rows += [tuple(row) for row in inputs.tolist()]
    return sorted(rows)


def test_rows_of_a_step_do_not_depend_on_world_size(corpus):
    root, doc = corpus
    reader = ReplayReader(doc, root, seed=1)
    for step in range(58 // 4):  # global batch 4 rows
        one = _step_rows(reader, step, world_size=1, micro_batch=2, grad_accum=2)
        assert one == _step_rows(reader, step, world_size=2, micro_batch=2, grad_accum=1)
        assert one == _step_rows(reader, step, world_size=4, micro_batch=1, grad_accum=1)
        assert len(set(one)) == 4


def test_batch_holds_the_planned_rows(corpus):
    root, doc = corpus
    reader = ReplayReader(doc, root, seed=5)
    layout = BatchLayout(micro_batch=3, grad_accum=2, rank=1, world_size=2)
    inputs, labels = reader.batch(3, 1, layout)  # G = 12; rows 36 + (1*2+1)*3 = 45..47
    refs = reader.global_rows(45, 3)
    expected = np.stack([read_rows(root / s / f, [r], L)[0] for s, f, r in refs])
    assert np.array_equal(inputs.numpy(), expected[:, :-1]) and np.array_equal(labels.numpy(), expected[:, 1:])


def test_no_batch_beyond_the_plan(corpus):
    root, doc = corpus
    reader = ReplayReader(doc, root, seed=0)
    reader.batch(13, 0, BatchLayout(micro_batch=4, grad_accum=1, rank=0, world_size=1))  # rows 52..55 of 58
    with pytest.raises(ReaderError, match="automatic dataset repetition is forbidden"):
        reader.batch(14, 0, BatchLayout(micro_batch=4, grad_accum=1, rank=0, world_size=1))
    with pytest.raises(ReaderError, match="outside the plan"):
        reader.global_rows(57, 2)
    with pytest.raises(ReaderError, match="invalid batch layout"):
        reader.batch(0, 0, BatchLayout(micro_batch=1, grad_accum=1, rank=2, world_size=2))
    with pytest.raises(ReaderError, match="micro_step 2"):
        reader.batch(0, 2, BatchLayout(micro_batch=1, grad_accum=2, rank=0, world_size=1))


class RecordingCache:
    """Stands in for ShardCache to observe which shards a rank asks for."""

    hold_budget = None
    generation = 0

    def __init__(self, root):
        self.root, self.got, self.prefetched = root, set(), []

    def expected_size(self, key):
        return (self.root / key[0] / key[1]).stat().st_size

    def hold_shard(self, source, file, seq_len):
        self.got.add((source, file))
        return MappedShard((source, file), self.root / source / file, seq_len)

    def prefetch(self, upcoming):
        self.prefetched.append(list(upcoming))


def test_each_rank_opens_only_its_own_shards(corpus):
    root, doc = corpus
    for rank in range(2):
        cache = RecordingCache(root)
        reader = ReplayReader(doc, None, seed=0, cache=cache, shuffle_window=0)
        reader.batch(0, 0, BatchLayout(micro_batch=5, grad_accum=1, rank=rank, world_size=2))
        mine = {(s, f) for s, f, _ in reader.global_rows(rank * 5, 5)}
        assert cache.got == mine
        firsts = [first for first in (10 * i + rank * 5 for i in range(1, 1 + _LOOKAHEAD_MICRO_BATCHES))
                  if first + 5 <= reader.num_rows]  # the next micro-batches of this rank, in the plan
        upcoming = {(s, f) for first in firsts for s, f, _ in reader.global_rows(first, 5)}
        assert set(cache.prefetched[-1]) == upcoming


def test_the_cache_is_asked_again_when_the_shards_named_change_not_their_order(tmp_path):
    """In a shuffled window the next micro-batches name the same few shards in another order at
    almost every look (every 16th micro-batch): the cache is asked again only when the shards
    named change, here at most twice per window of 64 micro-batches (17 times when a new order
    was enough), and each shard read after the first micro-batch was named to it before."""
    for source, start in (("a", 1), ("b", 20000)):
        write_shards(source, [np.arange(start, start + 256 * L + 1)], L, 32, tmp_path, vocab_size=30000,
                     tokenizer_hash="h")
    doc = build_plan(load_manifests([tmp_path]), 512 * L, dataset="t", revision="1")
    cache = RecordingCache(tmp_path)
    reader = ReplayReader(doc, None, seed=1, cache=cache, shuffle_window=128)
    for step in range(512 // 2):
        named = set().union(*map(set, cache.prefetched))
        opened = set(cache.got)
        reader.batch(step, 0, BatchLayout(micro_batch=2, grad_accum=1, rank=0, world_size=1))
        assert step == 0 or cache.got - opened <= named
    assert len(cache.got) == 16 and len(cache.prefetched) <= 2 * 4


def test_batches_through_a_bounded_cache_match_direct_reads(corpus, tmp_path):
    root, doc = corpus
    limit = 3 * (R * L + 1) * 2
    cache = open_corpus(doc, str(root)).open_cache(tmp_path / "cache", limit, prefetch=2)
    cached = ReplayReader(doc, None, seed=2, cache=cache)
    direct = ReplayReader(doc, root, seed=2)
    layout = BatchLayout(micro_batch=2, grad_accum=2, rank=0, world_size=1)
    for step in range(58 // 4):
        for micro in range(2):
            a, b = cached.batch(step, micro, layout), direct.batch(step, micro, layout)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert cache.stats()["bytes"] <= limit
    cache.wait_idle()
    assert cache.stats()["evictions"] > 0 and cache.stats()["hits"] > 0
    cache.close()


def test_refinement_plan_reads_the_core_only(corpus):
    root, doc = corpus
    reader = ReplayReader(derive_refinement(doc), root, seed=3, shuffle_window=8)
    pre = ReplayReader(doc, root, seed=3, shuffle_window=8)
    assert reader.num_rows == 35 and reader.global_rows(0, 35) == pre.global_rows(0, 35)


def test_huge_plans_need_no_per_row_table():
    doc = synthetic_plan({"web": 40_000_000, "code": 23_000_001}, passes={"code": 2}, shard_rows=32_768)
    started = time.perf_counter()
    reader = ReplayReader(doc, "unused", seed=11)
    tail = reader.global_rows(reader.num_rows - 700, 700)
    middle = reader.global_rows(40_000_000, 300)
    assert time.perf_counter() - started < 5
    assert reader.num_rows == 40_000_000 + 2 * 23_000_001
    assert {s for s, _, _ in tail} == {"code"} and {s for s, _, _ in middle} == {"web", "code"}


def test_the_plan_is_checked_against_the_manifests(corpus):
    root, doc = corpus
    manifests = load_manifests([root])
    assert set(open_corpus(doc, str(root)).manifests) == {"a", "b"}
    greedy = json.loads(json.dumps(doc))
    greedy["phases"][0]["sources"]["b"][-1]["rows"] = 3  # shard-00002 of b holds 2 rows
    with pytest.raises(CorpusError, match="takes 3 rows of b/shard-00002.bin, its manifest lists 2"):
        check_plan_manifests(greedy, manifests)
    other = dict(doc, tokenizer_sha256="different")
    with pytest.raises(CorpusError, match="expects tokenizer different"):
        open_corpus(other, str(root))


def _first_read_order(reader, start, end):
    """Brute force: the shards of global rows [start, end), ordered by the start of the shuffle
    window each is first read in, then source and file."""
    size, segment_starts, first = reader.shuffle_window, [s.start for s in reader.segments], {}
    for offset, (source, file, _) in enumerate(reader.global_rows(start, end - start)):
        row = start + offset
        segment = max(s for s in segment_starts if s <= row)
        first.setdefault((source, file), segment + (row - segment) // size * size)
    return [key for _, key in sorted((window, key) for key, window in first.items())]


@pytest.mark.parametrize("first", [0, 37, 150, 300, 410])
def test_plan_ahead_names_the_shards_of_the_horizon_in_first_read_order(first):
    """Across shuffle windows and passes, what the cache is asked to prefetch next is every shard
    read from the next window to the horizon, in the order of its first read (arithmetic, no
    window built), as reading the rows themselves finds it."""
    doc = synthetic_plan({"a": 200, "b": 120}, passes={"b": 2}, shard_rows=9)
    reader = ReplayReader(doc, "unused", seed=5, shuffle_window=16)
    start = (first // 16 + 1) * 16
    for rows in (20, 90, 400):
        end = reader.horizon.window_end(min(reader.num_rows, first + rows))
        expected = _first_read_order(reader, start, end) if start < end else []
        assert list(reader.horizon.keys(first, rows)) == expected[:64], (first, rows)


def test_the_prefetch_horizon_follows_the_measured_pace(monkeypatch):
    """Until the reader has run 0.2 s it looks two windows ahead; then as many rows as the plan
    reads in ``prefetch_s`` seconds at the pace kept since its first look."""
    from ds_trhash.data.stream.delivery import reader as reader_module

    now = [100.0]
    monkeypatch.setattr(reader_module.time, "monotonic", lambda: now[0])
    reader = ReplayReader(synthetic_plan({"a": 40}), "unused", seed=0, shuffle_window=8, prefetch_s=600)
    assert reader._horizon_rows(0) == 16
    now[0] = 100.1
    assert reader._horizon_rows(40) == 16  # not measured yet
    now[0] = 102.0
    assert reader._horizon_rows(200) == 100 * 600  # 200 rows in 2 s: 10 minutes ahead
