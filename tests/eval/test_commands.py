"""`ds-trhash eval piqa` / `eval heldout`, in-process, on a SafeTensors export of a fresh tiny model."""
import json
import warnings

import pytest
import torch

from tests.data.sft_fixtures import VOCAB_SIZE, build_test_tokenizer, conversation, write_jsonl
from ds_trhash.data.sft.build import build_sft_dataset
from ds_trhash.data.sft.dataset import SFTBatches, open_sft, pack
from ds_trhash.cli import main
from ds_trhash.data.formats.tokenizer import load_tokenizer
from ds_trhash.eval import commands
from ds_trhash.eval.heldout import heldout_loss
from ds_trhash.eval.piqa import PiqaCountWarning, evaluate_piqa, read_piqa
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.release.export.writer import export_safetensors

SEQ_LEN = 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli")
    tok_dir = build_test_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE)
    model = TRHashForCausalLM(config).eval()
    export = root / "export"
    export_safetensors(model.state_dict(), export, model_config=config.to_dict(), tokenizer_dir=tok_dir, stage="pretraining")
    train = write_jsonl(root / "train.jsonl", [{"messages": conversation(i)} for i in range(3)])
    held = write_jsonl(root / "eval.jsonl", [{"messages": conversation(i, turns=1 + i % 2)} for i in range(7)])
    sft = root / "sft"
    build_sft_dataset(train, held, tok_dir, SEQ_LEN, sft)
    piqa = write_jsonl(root / "piqa.jsonl", [
        {"goal": "How do you open a file?", "sol1": "Use the open function.", "sol2": "Use the close statement.", "label": 0},
        {"goal": "To repeat a block", "sol1": "write an if statement", "sol2": "write a for loop over a sequence", "label": 1},
        {"goal": "Define a function", "sol1": "with def", "sol2": "with class and import", "label": 0},
    ])
    return {"root": root, "tok": tok_dir, "export": export, "sft": sft, "piqa": piqa, "model": model}


def _run(argv):
    return main(argv)  # the real command line: its one handler prints a refusal and returns 2


def test_eval_piqa_writes_json_matching_the_library(setup, tmp_path, capsys):
    out = tmp_path / "piqa.json"
    argv = ["eval", "piqa", "--checkpoint", str(setup["export"]), "--tokenizer", str(setup["tok"]),
            "--data", str(setup["piqa"]), "--batch-size", "2", "--device", "cpu", "--out", str(out), "--per-example"]
    assert _run(argv) == 0
    captured = capsys.readouterr()
    assert "PIQA acc" in captured.out
    assert "warning: scored 3 PIQA examples, the validation split has 1838" in captured.err
    doc = json.loads(out.read_text())
    assert doc["task"] == "piqa" and doc["n"] == 3 and doc["expected_n"] == 1838 and doc["dtype"] == "float32"
    assert doc["model_config_source"].endswith("config.json") and len(doc["per_example"]) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PiqaCountWarning)
        direct = evaluate_piqa(setup["model"], load_tokenizer(setup["tok"]), read_piqa(setup["piqa"]))
    assert doc["acc"] == direct["acc"] and doc["acc_norm"] == direct["acc_norm"]


def test_eval_piqa_labels_file(setup, tmp_path, capsys):
    rows = [json.loads(line) for line in setup["piqa"].read_text().splitlines()]
    data = write_jsonl(tmp_path / "valid.jsonl", [{k: r[k] for k in ("goal", "sol1", "sol2")} for r in rows])
    labels = tmp_path / "valid-labels.lst"
    labels.write_text("".join(f"{r['label']}\n" for r in rows))
    out = tmp_path / "piqa.json"
    argv = ["eval", "piqa", "--checkpoint", str(setup["export"]), "--tokenizer", str(setup["tok"]), "--data", str(data),
            "--labels", str(labels), "--device", "cpu", "--out", str(out)]
    assert _run(argv) == 0
    capsys.readouterr()
    reference = tmp_path / "ref.json"
    _run(["eval", "piqa", "--checkpoint", str(setup["export"]), "--tokenizer", str(setup["tok"]),
          "--data", str(setup["piqa"]), "--device", "cpu", "--out", str(reference)])
    a, b = json.loads(out.read_text()), json.loads(reference.read_text())
    assert (a["acc"], a["acc_norm"], a["n"]) == (b["acc"], b["acc_norm"], b["n"])


def test_eval_piqa_bad_input_is_one_error_line(setup, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 0},
                                               {"goal": "g", "sol1": "a", "sol2": "b", "label": 3}])
    argv = ["eval", "piqa", "--checkpoint", str(setup["export"]), "--tokenizer", str(setup["tok"]), "--data", str(bad)]
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "bad.jsonl:2: label must be 0 or 1" in err[0]


def test_eval_piqa_refuses_another_tokenizer_than_the_export_records(setup, tmp_path, capsys):
    other = tmp_path / "tokenizer.json"
    other.write_text((setup["tok"] / "tokenizer.json").read_text() + "\n")
    argv = ["eval", "piqa", "--checkpoint", str(setup["export"]), "--tokenizer", str(other), "--data", str(setup["piqa"])]
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the tokenizer" in err[0]


def test_eval_heldout_matches_direct_computation(setup, tmp_path, capsys):
    out = tmp_path / "heldout.json"
    argv = ["eval", "heldout", "--checkpoint", str(setup["export"]), "--sft-dir", str(setup["sft"]),
            "--micro-batch", "2", "--policy", "per_document", "--device", "cpu", "--out", str(out)]
    assert _run(argv) == 0
    assert "held-out loss" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["task"] == "heldout" and doc["seq_len"] == SEQ_LEN and doc["examples"] == 7
    assert doc["tokenizer_checked"] is True
    data = open_sft(setup["sft"], VOCAB_SIZE, SEQ_LEN)
    packs = pack(data.partition("eval"), SEQ_LEN, "per_document")
    direct = heldout_loss(setup["model"], SFTBatches(packs, 3, 1, 0, 0, drop_last=False).epoch(0), torch.device("cpu"))
    assert doc["eval_tokens"] == direct["eval_tokens"] == data.partition("eval").supervised_tokens
    assert doc["eval_loss"] == pytest.approx(direct["eval_loss"], rel=1e-6)


def test_eval_heldout_refuses_a_set_built_with_another_tokenizer(setup, tmp_path, capsys):
    other_tok = tmp_path / "tok.json"
    other_tok.write_text((setup["tok"] / "tokenizer.json").read_text() + "\n")  # same content, other bytes
    export = tmp_path / "export"
    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE)
    export_safetensors(setup["model"].state_dict(), export, model_config=config.to_dict(),
                       tokenizer_dir=other_tok, stage="pretraining")
    argv = ["eval", "heldout", "--checkpoint", str(export), "--sft-dir", str(setup["sft"]), "--device", "cpu"]
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ds-trhash eval heldout: error:") and "tokenizer" in err[0]


def test_config_from_trainer_state_or_preset(tmp_path, capsys):
    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE)
    ckpt = tmp_path / "step_5"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 5, "model_config": config.to_dict()}))
    got, source = commands.resolve_config(ckpt, "200m")
    assert got == config and source.endswith("trainer_state.json model_config")
    assert "--preset 200m ignored" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    assert commands.resolve_config(bare, "tiny")[0] == TRHashConfig.from_preset("tiny")
    with pytest.raises(commands.EvalCommandError, match="pass --preset"):
        commands.resolve_config(bare, None)


def test_wrong_preset_for_the_weights_is_a_user_error(setup, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((setup["export"] / "model.safetensors").read_bytes())
    argv = ["eval", "heldout", "--checkpoint", str(bare), "--sft-dir", str(setup["sft"]), "--preset", "tiny",
            "--device", "cpu"]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert "do not fit the model from --preset tiny" in err and len(err.strip().splitlines()) == 1


def test_heldout_seq_len_beyond_the_model_positions_is_refused_before_allocating(setup, tmp_path, capsys):
    from tests.fail_closed import tree_digest

    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE)
    # A checkpoint that records its config but holds no weights: a check made after loading the
    # model would fail on the missing weights instead.
    ckpt = tmp_path / "step_5"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 5, "model_config": config.to_dict()}))
    before = tree_digest(tmp_path)
    argv = ["eval", "heldout", "--checkpoint", str(ckpt), "--sft-dir", str(setup["sft"]),
            "--seq-len", str(config.max_seq_len + 1), "--device", "cpu", "--out", str(tmp_path / "h.json")]
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--seq-len {config.max_seq_len + 1} exceeds the {config.max_seq_len} positions" in err[0]
    assert tree_digest(tmp_path) == before


def test_eval_heldout_uses_the_checkpoints_packing_policy_and_warns_when_told_otherwise(setup, tmp_path, capsys):
    export = tmp_path / "export"
    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE)
    export_safetensors(setup["model"].state_dict(), export, model_config=config.to_dict(), tokenizer_dir=setup["tok"],
                       stage="supervised-finetuning", extra_meta={"packing_policy": "per_document"})
    base = ["eval", "heldout", "--checkpoint", str(export), "--sft-dir", str(setup["sft"]), "--device", "cpu"]
    assert _run([*base, "--out", str(tmp_path / "default.json")]) == 0
    doc, err = json.loads((tmp_path / "default.json").read_text()), capsys.readouterr().err
    assert doc["policy"] == "per_document" and doc["policy_source"].endswith("run.json") and "warning" not in err
    assert _run([*base, "--policy", "cross_document", "--out", str(tmp_path / "other.json")]) == 0
    doc, err = json.loads((tmp_path / "other.json").read_text()), capsys.readouterr().err
    assert doc["policy"] == "cross_document" and doc["policy_source"] == "--policy"
    assert "warning: --policy cross_document differs from the per_document packing" in err


def test_packing_policy_comes_from_the_training_checkpoint_or_defaults_with_a_note(tmp_path, capsys):
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"training_critical": {"data.packing.policy": "per_document"}}))
    assert commands._packing_policy(ckpt, None)[0] == "per_document"
    assert commands._packing_policy(ckpt, "per_document") == ("per_document", "--policy")
    assert capsys.readouterr().err == ""
    assert commands._packing_policy(tmp_path, None)[0] == "cross_document"  # records nothing
    assert "records no packing policy; using cross_document" in capsys.readouterr().err


def test_eval_piqa_refuses_a_non_checkpoint_a_max_len_beyond_the_positions_and_non_utf8_data(setup, tmp_path, capsys):
    from tests.fail_closed import tree_digest

    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("not a model")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"goal": "caf\xe9", "sol1": "a", "sol2": "b", "label": 0}\n')
    before = tree_digest(tmp_path)
    common = ["--tokenizer", str(setup["tok"]), "--device", "cpu", "--out", str(tmp_path / "p.json")]
    for argv, needle in (
            (["--checkpoint", str(notes), "--data", str(setup["piqa"])], f"--checkpoint {notes} is not a checkpoint or an export"),
            (["--checkpoint", str(tmp_path / "latin.jsonl"), "--data", str(setup["piqa"])], "is not a directory"),
            (["--checkpoint", str(setup["export"]), "--data", str(setup["piqa"]), "--max-len", str(config.max_seq_len + 1)],
             f"--max-len {config.max_seq_len + 1} exceeds the {config.max_seq_len} positions of the model"),
            (["--checkpoint", str(setup["export"]), "--data", str(latin)], f"{latin}: line 1 is not UTF-8 text")):
        assert _run(["eval", "piqa", *argv, *common]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert tree_digest(tmp_path) == before
