import json
import time

import pytest

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.embedded import SYSTEM_PROMPT, EmbeddedError, build_embedded
from ds_trhash.data.plans.plan import load_plan, validate_refinement
from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.data.formats.shards import load_manifests
from ds_trhash.data.formats.tokenizer import load_tokenizer, tokenizer_sha256
from tests.fail_closed import tree_digest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded") / "demo"
    started = time.perf_counter()
    paths = build_embedded(root)
    return paths, time.perf_counter() - started


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_builds_quickly_from_python_docs_alone(built):
    paths, seconds = built
    assert seconds < 30
    tok = load_tokenizer(paths.tokenizer_dir)
    assert tok.get_vocab_size() == 4096 and tok.token_to_id("</s>") == 0
    manifests = load_manifests([paths.shards_dir])
    assert set(manifests) == {"topics_a", "topics_b"}
    assert {m["tokenizer_sha256"] for m in manifests.values()} == {tokenizer_sha256(paths.tokenizer_dir)}
    assert all(m["seq_len"] == 128 and m["vocab_size"] == 4096 for m in manifests.values())


def test_plans_replay_one_source_and_refinement_matches(built):
    paths, _ = built
    pre, ref = load_plan(paths.pretrain_plan), load_plan(paths.refine_plan)
    assert [p["name"] for p in pre.phases] == ["unique_core", "quality_replay_2"]
    assert set(pre.phases[1]["sources"]) == {"topics_a"}
    assert pre.trained_tokens > pre.unique_tokens == ref.trained_tokens
    validate_refinement(ref, pre)
    assert pre.doc["dataset"] == "pydoc_data.topics"
    reader = ReplayReader(pre, paths.shards_dir, seed=0)
    inputs, labels = reader.batch(0, 0, BatchLayout(micro_batch=4, grad_accum=1, rank=0, world_size=1))
    assert inputs.shape == (4, 128) and int(inputs.max()) < 4096


def test_chat_sets_are_well_formed_disjoint_and_fit_the_context(built):
    paths, _ = built
    train, evaluation = read_jsonl(paths.chat_train_jsonl), read_jsonl(paths.chat_eval_jsonl)
    assert (len(train), len(evaluation)) == (300, 40)
    tok = load_tokenizer(paths.tokenizer_dir)
    for record in train + evaluation:
        messages = record["messages"]
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * ((len(messages) - 1) // 2)
        assert all(m["content"].strip() for m in messages)
        rendered = "".join(f"{m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages)
        assert len(tok.encode(rendered).ids) < 128
    assert sum(len(r["messages"]) > 3 for r in train) >= 10  # some multi-turn conversations
    as_text = {json.dumps(r, sort_keys=True) for r in train}
    assert not as_text & {json.dumps(r, sort_keys=True) for r in evaluation}


def test_second_call_reuses_and_a_damaged_corpus_is_refused_never_rebuilt_in_place(built):
    paths, _ = built
    out = paths.root.parent
    assert paths.root.name.startswith("corpus-")
    mtime = paths.pretrain_plan.stat().st_mtime_ns
    started = time.perf_counter()
    assert build_embedded(out) == paths
    assert time.perf_counter() - started < 1
    assert paths.pretrain_plan.stat().st_mtime_ns == mtime
    original = paths.chat_eval_jsonl.read_bytes()
    try:
        paths.chat_eval_jsonl.write_text("damaged\n")
        before = tree_digest(out)
        with pytest.raises(EmbeddedError, match="is damaged .* left untouched"):
            build_embedded(out)
        assert tree_digest(out) == before  # nothing rebuilt, replaced or added
    finally:
        paths.chat_eval_jsonl.write_bytes(original)
    # Another request (seq_len) gets its own directory beside the first, which stays as it is.
    other = build_embedded(out, seq_len=160)
    assert other.root.parent == out and other.root != paths.root
    assert build_embedded(out) == paths


def test_build_is_deterministic_and_seed_only_reorders_chat(built, tmp_path):
    paths, _ = built
    again = build_embedded(tmp_path / "again")
    for name in ("pretrain_plan", "refine_plan", "chat_train_jsonl", "chat_eval_jsonl"):
        assert getattr(again, name).read_bytes() == getattr(paths, name).read_bytes()
    reseeded = build_embedded(tmp_path / "seeded", seed=1)
    assert reseeded.pretrain_plan.read_bytes() == paths.pretrain_plan.read_bytes()
    assert reseeded.chat_train_jsonl.read_bytes() != paths.chat_train_jsonl.read_bytes()
