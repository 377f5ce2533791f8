"""Opening an SFT set fail-closed, packing, per-epoch order and per-rank batches."""
import json
import re
import shutil

import numpy as np
import pytest
import torch
from tests.data.sft_fixtures import VOCAB_SIZE, conversation, write_jsonl

from ds_trhash.data.sft.chat import EOS_ID, IGNORE_INDEX, PAD_ID, tokenize_example
from ds_trhash.io import sha256_file
from ds_trhash.data.sft.build import build_sft_dataset
from ds_trhash.data.sft.dataset import SFTBatches, SFTDataError, epoch_order, open_sft, pack

SEQ = 256


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("sft_set")
    records = [{"messages": conversation(i, turns=1 + i % 3)} for i in range(60)]
    train = write_jsonl(root / "train.jsonl", records)
    evaluation = write_jsonl(root / "eval.jsonl", [{"messages": conversation(200 + i)} for i in range(5)])
    build_sft_dataset(train, evaluation, tokenizer_dir, SEQ, root / "sft")
    return root / "sft", records


@pytest.fixture(scope="module")
def data(built):
    return open_sft(built[0], VOCAB_SIZE, SEQ)


@pytest.fixture()
def copy(built, tmp_path):
    return shutil.copytree(built[0], tmp_path / "sft")


def test_open_maps_every_example(built, data, tokenizer):
    train = data.partition("train")
    assert len(train) == 60 and len(data.partition("eval")) == 5
    for i in (0, 17, 59):
        ids, labels = train.example(i)
        expected = tokenize_example(built[1][i]["messages"], tokenizer)
        assert ids.tolist() == expected.input_ids and labels.tolist() == expected.labels
    assert data.tokenizer_hash == sha256_file(data.tokenizer_path)
    with pytest.raises(SFTDataError, match="unknown SFT partition 'test'"):
        data.partition("test")


def _flip_byte(path, position):
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_byte_in_labels_is_detected_naming_the_file(copy):
    _flip_byte(copy / "train" / "labels.bin", 40)
    with pytest.raises(SFTDataError, match=r"train/labels\.bin: SHA-256 does not match"):
        open_sft(copy, VOCAB_SIZE, SEQ)


def test_wrong_tokenizer_hash_vocab_and_window_are_refused(data, built):
    with pytest.raises(SFTDataError, match="tokenizer.sha256.*different tokenizer"):
        open_sft(built[0], VOCAB_SIZE, SEQ, tokenizer_hash="0" * 64)
    assert open_sft(built[0], VOCAB_SIZE, SEQ, tokenizer_hash=data.tokenizer_hash).tokenizer_hash == data.tokenizer_hash
    with pytest.raises(SFTDataError, match="'vocab_size' is 512, expected 32000"):
        open_sft(built[0], 32000, SEQ)
    longest = max(e.num_tokens for e in data.partition("train").examples)
    with pytest.raises(SFTDataError, match=f"has {longest} tokens, more than the configured seq_len {longest - 1}"):
        open_sft(built[0], VOCAB_SIZE, longest - 1)


def test_missing_manifest_or_listed_file_is_refused(copy):
    (copy / "eval" / "examples.jsonl").unlink()
    with pytest.raises(SFTDataError, match=r"eval/examples\.jsonl is listed in the manifest but missing"):
        open_sft(copy, VOCAB_SIZE, SEQ)
    (copy / "manifest.json").unlink()
    with pytest.raises(SFTDataError, match="manifest.json is missing"):
        open_sft(copy, VOCAB_SIZE, SEQ)


@pytest.mark.parametrize("name, needle", [("../victim.bin", "'..' part"), ("/etc/passwd", "absolute path"),
                                           ("link.bin", "outside")])
def test_a_manifest_naming_a_file_outside_the_set_is_refused_and_nothing_is_read(copy, tmp_path, name, needle):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"not the set's")
    (copy / "link.bin").symlink_to(victim)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][name] = sha256_file(victim)  # the hash made to match
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SFTDataError, match=f"field 'files.{re.escape(name)}'") as info:
        open_sft(copy, VOCAB_SIZE, SEQ)
    assert needle in str(info.value) and "sft build" in str(info.value)


def _rehash(root):
    """Re-sign the manifest after an edit, as a careless rebuild would: only deep checks remain."""
    manifest = json.loads((root / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = sha256_file(root / name)
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("value, message", [
    (IGNORE_INDEX, "final label of an example is not the supervised EOS"),
    (VOCAB_SIZE, "label outside"),
    (7, "final label of an example is not the supervised EOS"),
])
def test_resigned_bad_labels_are_still_detected(copy, data, value, message):
    last = data.partition("train").examples[3]
    labels = np.fromfile(copy / "train" / "labels.bin", dtype="<i4")
    labels[last.offset + last.num_tokens - 1] = value
    labels.tofile(copy / "train" / "labels.bin")
    _rehash(copy)
    with pytest.raises(SFTDataError, match=f"example {last.example_id}: {message}"):
        open_sft(copy, VOCAB_SIZE, SEQ)


def test_resigned_unshifted_labels_and_wrong_counts_are_detected(copy, data):
    ref = data.partition("train").examples[5]
    labels = np.fromfile(copy / "train" / "labels.bin", dtype="<i4")
    labels[ref.offset + ref.num_tokens - 2] += 1
    labels.tofile(copy / "train" / "labels.bin")
    _rehash(copy)
    with pytest.raises(SFTDataError, match="differs from the next input id"):
        open_sft(copy, VOCAB_SIZE, SEQ)
    labels[ref.offset + ref.num_tokens - 2] = IGNORE_INDEX
    labels.tofile(copy / "train" / "labels.bin")
    _rehash(copy)
    with pytest.raises(SFTDataError, match=r"examples\.jsonl:6 says \d+ supervised tokens, labels\.bin holds"):
        open_sft(copy, VOCAB_SIZE, SEQ)


def _check_pack_layout(packs, part, seq_len):
    seen = []
    supervised = 0
    for p in packs:
        arrays = p.arrays()
        assert all(a.shape == (seq_len,) and a.dtype == np.int64 for a in arrays.values())
        cursor = 0
        for k, i in enumerate(p.examples):
            if k:
                assert arrays["input_ids"][cursor] == EOS_ID and arrays["labels"][cursor] == IGNORE_INDEX
                cursor += 1
            ids, labels = part.example(i)
            assert arrays["input_ids"][cursor:cursor + len(ids)].tolist() == ids.tolist()
            assert arrays["labels"][cursor:cursor + len(ids)].tolist() == labels.tolist()
            cursor += len(ids)
        assert cursor == p.used_tokens <= seq_len
        assert (arrays["input_ids"][cursor:] == PAD_ID).all() and (arrays["labels"][cursor:] == IGNORE_INDEX).all()
        supervised += int((arrays["labels"] != IGNORE_INDEX).sum())
        seen += p.examples
    return seen, supervised


@pytest.mark.parametrize("policy", ["cross_document", "per_document"])
def test_packing_keeps_every_example_whole_once(data, policy):
    part = data.partition("train")
    packs = pack(part, SEQ, policy)
    seen, supervised = _check_pack_layout(packs, part, SEQ)
    assert seen == list(range(len(part)))  # each exactly once, in stored order
    assert supervised == part.supervised_tokens == sum(p.supervised_tokens for p in packs)
    for before, after in zip(packs, packs[1:]):  # next-fit: the next example did not fit the open window
        assert before.used_tokens + 1 + part.examples[after.examples[0]].num_tokens > SEQ
    assert any(len(p.examples) > 1 for p in packs)


def test_per_document_positions_restart_and_documents_are_distinct(data):
    part = data.partition("train")
    p = next(p for p in pack(part, SEQ, "per_document") if len(p.examples) >= 2)
    arrays = p.arrays()
    lengths = [part.examples[i].num_tokens for i in p.examples]
    expected_pos, expected_doc = [], []
    for k, n in enumerate(lengths):
        expected_pos += list(range(n)) + ([n] if k < len(lengths) - 1 else [])  # separator continues its document
        expected_doc += [k] * (n + (k < len(lengths) - 1))
    pad = SEQ - len(expected_pos)
    assert arrays["position_ids"].tolist() == expected_pos + list(range(pad))
    assert arrays["document_ids"].tolist() == expected_doc + [len(lengths)] * pad
    cross = next(c for c in pack(part, SEQ, "cross_document") if c.examples == p.examples).arrays()
    assert cross["input_ids"].tolist() == arrays["input_ids"].tolist()
    assert cross["position_ids"].tolist() == list(range(SEQ)) and not cross["document_ids"].any()


def test_unknown_policy_and_oversized_window_are_rejected(data):
    part = data.partition("train")
    with pytest.raises(SFTDataError, match="allowed: cross_document, per_document"):
        pack(part, SEQ, "document")
    with pytest.raises(SFTDataError, match="never split"):
        pack(part, 64, "cross_document")


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    assert epoch_order(7, 2, 50) == epoch_order(7, 2, 50)
    assert sorted(epoch_order(7, 2, 50)) == list(range(50))
    assert epoch_order(7, 1, 50) != epoch_order(7, 2, 50)
    assert epoch_order(7, 1, 50) != epoch_order(8, 1, 50)
    first = epoch_order(7, 1, 50)
    assert epoch_order(7, 2, 50) != [first[i] for i in epoch_order(7, 1, 50)]  # not a reshuffle of epoch 1


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_mid_epoch_reproduces_uninterrupted_batches(data):
    packs = pack(data.partition("train"), SEQ, "per_document")
    run = SFTBatches(packs, micro_batch=2, world_size=2, rank=1, seed=11)
    uninterrupted = [list(run.epoch(e)) for e in range(3)]
    k = run.batches_per_epoch // 2
    resumed = SFTBatches(packs, micro_batch=2, world_size=2, rank=1, seed=11)
    tail = list(resumed.epoch(2, start=k))
    assert len(tail) == run.batches_per_epoch - k
    assert all(_same(a, b) for a, b in zip(tail, uninterrupted[2][k:]))
    assert not _same(uninterrupted[1][0], uninterrupted[2][0])
    batch = tail[0]
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(t.dtype == torch.int64 and t.shape == (2, SEQ) for t in batch.values())


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_get_equal_counts_and_disjoint_packs(data, world_size, drop_last):
    packs = pack(data.partition("train"), SEQ, "cross_document")
    ranks = [SFTBatches(packs, 2, world_size, r, seed=3, drop_last=drop_last) for r in range(world_size)]
    counts = {b.batches_per_epoch for b in ranks}
    assert len(counts) == 1
    G = 2 * world_size
    assert counts.pop() == (len(packs) // G if drop_last else -(-len(packs) // G))
    for epoch in (0, 1):
        taken = [i for b in ranks for index in range(b.batches_per_epoch) for i in b.pack_indices(epoch, index)]
        real = [i for i in taken if i is not None]
        assert len(real) == len(set(real))  # disjoint across ranks and batches
        if drop_last:
            assert len(real) == len(packs) - len(packs) % G
        else:
            assert sorted(real) == list(range(len(packs)))  # evaluation sees every pack
    last = ranks[-1]
    index = last.batches_per_epoch - 1
    labels = last.batch(1, index)["labels"]
    assert last.supervised_tokens(1, index) == int((labels != IGNORE_INDEX).sum())
    assert last.supervised_tokens(1, index, all_ranks=True) == sum(b.supervised_tokens(1, index) for b in ranks)


def test_too_few_packs_for_a_global_batch_is_an_error(data):
    packs = pack(data.partition("eval"), SEQ, "cross_document")
    with pytest.raises(SFTDataError, match="no full global batch"):
        SFTBatches(packs, micro_batch=len(packs), world_size=2, rank=0, seed=0)
    filled = SFTBatches(packs, micro_batch=len(packs), world_size=2, rank=1, seed=0, drop_last=False)
    assert filled.pack_indices(0, 0) == [None] * len(packs)
    assert filled.supervised_tokens(0, 0) == 0 and (filled.batch(0, 0)["input_ids"] == PAD_ID).all()
