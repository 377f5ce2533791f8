"""PIQA scoring (docs/contracts.md §8) against a token-by-token reference on a tiny random model."""
import json
import math

import pytest
import torch

from ds_trhash.eval import piqa
from ds_trhash.eval.piqa import (PIQA_VALIDATION_SIZE, PiqaCountWarning, PiqaDataError, PiqaExample, build_request,
                                 evaluate_piqa, read_piqa)
from ds_trhash.model import TRHashConfig, TRHashForCausalLM

VOCAB = 64


class CharTokenizer:
    """One token per character (ids 4..VOCAB-1); a BOS-adding tokenizer unless told not to."""

    def encode(self, text, add_special_tokens=True):
        ids = [4 + ord(c) % (VOCAB - 4) for c in text]
        return ([2] if add_special_tokens else []) + ids


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TRHashForCausalLM(TRHashConfig.from_preset("tiny", vocab_size=VOCAB, num_layers=2, max_seq_len=64))
    # Larger embeddings than the init make the log-probs spread, so predictions vary by example.
    with torch.no_grad():
        m.embed_tokens.weight.mul_(20)
    return m.eval()


def _examples():
    goals = ["Open a jar", "Dry wet shoes quickly", "Cut bread", "Keep ants away from sugar", "Boil an egg",
             "Clean a mirror", "Fold a shirt"]
    sols = [("twist the lid", "bang it hard on the floor"), ("stuff them with newspaper", "put them in the fridge"),
            ("use a knife", "use a spoon"), ("seal it in a jar", "leave it open"), ("put it in hot water", "freeze it"),
            ("wipe with vinegar", "rub with butter"), ("lay it flat, then fold", "crumple")]
    return [PiqaExample(g, a, b, i % 2) for i, (g, (a, b)) in enumerate(zip(goals, sols))]


@torch.no_grad()
def _reference_logprobs(model, tokens, n_cont):
    """Each continuation token's log-prob, one forward per token over exactly its prefix."""
    out = []
    for pos in range(len(tokens) - n_cont, len(tokens)):
        prefix = torch.tensor([tokens[:pos]])
        logits = model(prefix)[0, -1].double()
        out.append(float(logits.log_softmax(-1)[tokens[pos]]))
    return out


def _reference(model, tok, examples, max_len):
    acc = acc_norm = 0
    rows = []
    for ex in examples:
        sums, means = [], []
        ctx = tok.encode(ex.goal, add_special_tokens=False)
        for sol in (ex.sol1, ex.sol2):
            cont = tok.encode(" " + sol, add_special_tokens=False)
            tokens = (ctx + cont)[-(max_len + 1):]  # the model reads at most max_len of them
            lps = _reference_logprobs(model, tokens, len(cont))
            sums.append(sum(lps))
            means.append(sum(lps) / len(lps))
        acc += (0 if sums[0] >= sums[1] else 1) == ex.label
        acc_norm += (0 if means[0] >= means[1] else 1) == ex.label
        rows.append((sums, means))
    return acc / len(examples), acc_norm / len(examples), rows


@pytest.mark.parametrize("max_len,batch_size", [(64, 3), (28, 4)])
def test_matches_token_by_token_reference(model, max_len, batch_size):
    tok, examples = CharTokenizer(), _examples()
    with pytest.warns(PiqaCountWarning):
        got = evaluate_piqa(model, tok, examples, max_len=max_len, batch_size=batch_size, per_example=True)
    acc, acc_norm, rows = _reference(model, tok, examples, max_len)
    assert got["n"] == len(examples) and got["expected_n"] == PIQA_VALIDATION_SIZE
    assert got["acc"] == pytest.approx(acc) and got["acc_norm"] == pytest.approx(acc_norm)
    for row, (sums, means) in zip(got["per_example"], rows):
        assert row["sum_logprob"] == pytest.approx(sums, abs=1e-4)
        assert row["mean_logprob"] == pytest.approx(means, abs=1e-4)
    # The predictions are not all the same, so acc is not a constant the test could miss.
    assert len({row["pred"] for row in got["per_example"]}) == 2
    assert (got["truncated"] > 0) == (max_len == 28)


def test_batching_and_padding_do_not_change_scores(model):
    tok, examples = CharTokenizer(), _examples()
    requests = [r for ex in examples for r in piqa.piqa_requests(tok, ex, 64)]
    one = piqa.score_requests(model, requests, batch_size=1)
    many = piqa.score_requests(model, requests, batch_size=len(requests))
    assert many == pytest.approx(one, abs=1e-4)


def test_no_bos_and_separate_tokenization():
    tok = CharTokenizer()
    r = build_request(tok, "goal", " sol", max_len=100)
    assert r.ids == tuple(tok.encode("goal", False) + tok.encode(" sol", False))
    assert 2 not in r.ids and r.continuation_tokens == 4 and r.dropped_context_tokens == 0


def test_real_tokenizer_post_processor_bos_is_not_added():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"</s>": 0, "<pad>": 1, "<s>": 2, "<unk>": 3, "a": 4, "Ġb": 5, "b": 6, "Ġ": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    assert tok.encode("a").ids[0] == 2  # the tokenizer would add BOS by default
    r = build_request(tok, "a", " b", max_len=10)
    assert r.ids[0] != 2 and 2 not in r.ids


def test_left_truncation_keeps_the_continuation_and_drops_the_oldest_context():
    tok = CharTokenizer()
    ctx, cont = tok.encode("abcdefghij", False), tok.encode(" xyz", False)
    r = build_request(tok, "abcdefghij", " xyz", max_len=7)
    # The model reads ids[:-1] (7 tokens); the whole continuation (4) stays, the 6 oldest context go.
    assert len(r.ids) == 8 and r.ids[-4:] == tuple(cont) and r.ids[:4] == tuple(ctx[-4:])
    assert r.continuation_tokens == 4 and r.dropped_context_tokens == 6
    # A continuation that fills the whole window keeps exactly one context token.
    r = build_request(tok, "abcdefghij", " xyz", max_len=4)
    assert r.ids == tuple(ctx[-1:] + cont)
    with pytest.raises(PiqaDataError, match="cannot be scored whole"):
        build_request(tok, "abc", " xyz", max_len=3)
    with pytest.raises(PiqaDataError, match="tokenizes to nothing"):
        build_request(tok, "", " xyz", max_len=30)


def test_acc_and_acc_norm_disagree(monkeypatch):
    tok = CharTokenizer()
    # sol1 has 10 continuation tokens (" " + 9 chars), sol2 has 3.
    examples = [PiqaExample("goal", "123456789", "ab", 0), PiqaExample("goal", "123456789", "ab", 1)]
    # sol1: sum -10, mean -1; sol2: sum -6, mean -2 -> acc picks sol2, acc_norm picks sol1.
    monkeypatch.setattr(piqa, "score_requests", lambda model, reqs, batch_size=16, device=None: [-10.0, -6.0] * 2)
    with pytest.warns(PiqaCountWarning):
        got = evaluate_piqa(torch.nn.Linear(1, 1), tok, examples, per_example=True)
    assert [r["pred"] for r in got["per_example"]] == [1, 1]
    assert [r["pred_norm"] for r in got["per_example"]] == [0, 0]
    assert got["per_example"][0]["mean_logprob"] == [-1.0, -2.0]
    assert got["acc"] == 0.5 and got["acc_norm"] == 0.5
    assert got["per_example"][0]["pred"] != got["per_example"][0]["pred_norm"]


def test_ties_go_to_the_first_solution(monkeypatch):
    monkeypatch.setattr(piqa, "score_requests", lambda model, reqs, batch_size=16, device=None: [-3.0, -3.0])
    with pytest.warns(PiqaCountWarning):
        got = evaluate_piqa(None, CharTokenizer(), [PiqaExample("g", "ab", "cd", 0)])
    assert got["acc"] == 1.0 and got["acc_norm"] == 1.0


def test_full_split_count_does_not_warn(monkeypatch, recwarn):
    monkeypatch.setattr(piqa, "score_requests", lambda model, reqs, batch_size=16, device=None: [-1.0, -2.0] * len(reqs))
    got = evaluate_piqa(None, CharTokenizer(), [PiqaExample("g", "a", "b", 0)] * PIQA_VALIDATION_SIZE)
    assert got["warning"] is None and got["acc"] == 1.0
    assert not [w for w in recwarn if issubclass(w.category, PiqaCountWarning)]


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_read_jsonl_and_labels_file(tmp_path):
    rows = [{"id": "a", "goal": "g1", "sol1": "s1", "sol2": "t1"}, {"id": "b", "goal": "g2", "sol1": "s2", "sol2": "t2"}]
    data = _write(tmp_path / "valid.jsonl", rows + [""])
    labels = _write(tmp_path / "valid-labels.lst", ["1", "0"])
    assert read_piqa(data, labels) == [PiqaExample("g1", "s1", "t1", 1), PiqaExample("g2", "s2", "t2", 0)]
    with_labels = _write(tmp_path / "l.jsonl", [dict(r, label=i) for i, r in enumerate(rows)])
    assert [e.label for e in read_piqa(with_labels)] == [0, 1]
    with pytest.raises(PiqaDataError, match=r"valid.jsonl:1: missing field 'label'"):
        read_piqa(data)
    with pytest.raises(PiqaDataError, match=r"valid.jsonl:2: .*short.lst has only 1 labels"):
        read_piqa(data, _write(tmp_path / "short.lst", ["1"]))
    with pytest.raises(PiqaDataError, match="has 3 labels for 2 examples"):
        read_piqa(data, _write(tmp_path / "long.lst", ["1", "0", "1"]))
    with pytest.raises(PiqaDataError, match=r"l.jsonl:1: label 0 disagrees"):
        read_piqa(with_labels, labels)
    with pytest.raises(PiqaDataError, match=r"bad.lst:2: label must be 0 or 1"):
        read_piqa(data, _write(tmp_path / "bad.lst", ["1", "2"]))


@pytest.mark.parametrize("line,match", [
    ({"goal": "g", "sol1": "a", "label": 0}, r":2: missing field 'sol2'"),
    ({"goal": "g", "sol1": "a", "sol2": "b", "label": 2}, r":2: label must be 0 or 1, got 2"),
    ({"goal": "g", "sol1": "a", "sol2": "b", "label": True}, r":2: label must be 0 or 1"),
    ({"goal": "g", "sol1": 3, "sol2": "b", "label": 1}, r":2: field 'sol1' must be a string"),
    ({"goal": "", "sol1": "a", "sol2": "b", "label": 1}, r":2: field 'goal' is empty"),
    ('{"goal": ', r":2: not valid JSON"),
    ("[1, 2]", r":2: expected a JSON object"),
])
def test_invalid_lines_are_named(tmp_path, line, match):
    path = _write(tmp_path / "p.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}, line])
    with pytest.raises(PiqaDataError, match=match):
        read_piqa(path)


def test_empty_file_is_refused(tmp_path):
    with pytest.raises(PiqaDataError, match="no examples"):
        read_piqa(_write(tmp_path / "e.jsonl", [""]))


def test_model_mode_is_restored(model):
    model.train()
    try:
        piqa.score_requests(model, [build_request(CharTokenizer(), "ab", " c", 8)])
        assert model.training
    finally:
        model.eval()
    assert math.isfinite(piqa.score_requests(model, [build_request(CharTokenizer(), "ab", " c", 8)])[0])
