"""`ds-trhash generate` on the shared tiny export and on a training checkpoint of the same
weights: greedy output equals transformers' generate and seeded sampling is reproducible (both
through the real console script), the chat template and a checkpoint give the export's output,
EOS stops it, and user errors exit 2 with one line and change nothing (the same handler,
in-process: each console-script start costs ~9 CPU-seconds of imports)."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_trhash.cli import main
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from ds_trhash.release.export.writer import export_safetensors
from tests.release.checkpoint_utils import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
CLI = Path(sys.executable).with_name("ds-trhash")
PROMPT = "The for statement is used to"
QUESTION, SYSTEM = "What does the for statement do?", "You answer questions about Python."


def generate_cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(CLI), "generate", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def reference(tiny_export):
    """What a transformers user gets from the export: model, tokenizer, and a generate helper."""
    model = AutoModelForCausalLM.from_pretrained(tiny_export.out, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(tiny_export.out, trust_remote_code=True)

    def run(text, new, seed=None, **sampling):
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, eos_token_id=0,
                                 pad_token_id=1, **(sampling or {"do_sample": False}))
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), out[0, ids.shape[1]:].tolist()

    return model, tok, run


def test_greedy_prompt_prints_what_transformers_generate_returns(tiny_export, reference):
    text, ids = reference[2](PROMPT, 24)
    assert len(ids) == 24 and len(set(ids)) > 3  # (a random model's bytes need not be valid UTF-8)
    done = generate_cli("--model", tiny_export.out, "--prompt", PROMPT, "--max-new-tokens", 24)
    assert done.returncode == 0, done.stderr
    assert done.stdout == text + "\n"
    assert "loaded export" in done.stderr and "reached --max-new-tokens 24" in done.stderr


def test_seeded_sampling_is_reproducible(tiny_export, reference):
    run = reference[2]
    sampling = {"do_sample": True, "temperature": 0.9, "top_p": 0.9, "top_k": 0}
    expected, _ = run(PROMPT, 20, seed=7, **sampling)
    assert expected != run(PROMPT, 20, seed=8, **sampling)[0] and expected != run(PROMPT, 20)[0]
    done = generate_cli("--model", tiny_export.out, "--prompt", PROMPT, "--max-new-tokens", 20,
                        "--temperature", 0.9, "--top-p", 0.9, "--seed", 7)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"


def test_chat_on_a_training_checkpoint_equals_the_export(tiny_export, reference, tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "run", tiny_export.config, tiny_export.state,
                            tokenizer_dir=str(tiny_export.tokenizer_dir),
                            tokenizer_sha256=tokenizer_sha256(tiny_export.tokenizer_dir))
    tok = reference[1]
    prompt = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt == f"System:\n{SYSTEM}\n\nUser:\n{QUESTION}\n\nAssistant:\n"
    expected, _ = reference[2](prompt, 16)
    assert main(["generate", "--model", str(ckpt), "--chat", QUESTION, "--system", SYSTEM,
                 "--max-new-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n" and "loaded checkpoint" in captured.err


def test_generation_stops_at_eos(tiny_export, tmp_path, capsys):
    """A model whose final norm zeroes every hidden state gives all-equal logits; greedy then
    picks id 0, the EOS, at once. (In-process: the same handler as the console script.)"""
    state = dict(tiny_export.state, **{"norm.weight": torch.zeros(tiny_export.config.hidden_size)})
    out = tmp_path / "eos"
    export_safetensors(state, out, model_config=tiny_export.config.to_dict(), tokenizer_dir=tiny_export.tokenizer_dir)
    assert main(["generate", "--model", str(out), "--prompt", PROMPT, "--max-new-tokens", "30"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n" and "[1 new tokens after a" in captured.err and "stopped at EOS" in captured.err


def test_tokens_reach_the_streamer_one_at_a_time(tiny_export, monkeypatch, capsys):
    from transformers import TextStreamer

    calls = []
    real = TextStreamer.put
    monkeypatch.setattr(TextStreamer, "put", lambda self, value: (calls.append(value.numel()), real(self, value)))
    assert main(["generate", "--model", str(tiny_export.out), "--prompt", PROMPT, "--max-new-tokens", "9"]) == 0
    assert calls[1:] == [1] * 9  # the prompt, then every new token as soon as it exists
    assert capsys.readouterr().out.strip()


def _tree_digest(root):
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def test_user_errors_exit_2_with_one_line_and_change_nothing(tiny_export, tmp_path, capsys):
    before = _tree_digest(tiny_export.out)
    ending = tmp_path / "ends_with_assistant.json"
    ending.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}')
    other_tokenizer = tmp_path / "other" / "tokenizer.json"  # another tokenizer than the export's
    other_tokenizer.parent.mkdir()
    other_tokenizer.write_text((Path(tiny_export.out) / "tokenizer.json").read_text() + "\n")
    model = ["--model", str(tiny_export.out)]
    cases = [
        (["--model", str(tmp_path / "missing"), "--prompt", PROMPT], "is not a directory"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", PROMPT, "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt", PROMPT, "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--prompt", PROMPT, "--system", "s"], "--system goes with --chat"),
        (["--messages", str(tmp_path / "nope.json")], "does not exist"),
        (["--messages", str(ending)], "ends with an assistant turn"),
        (["--chat", "hi", "--max-new-tokens", "500"], "exceeds the model's context of 128 tokens"),
        (["--prompt", PROMPT, "--device", "cuda:0" if not torch.cuda.is_available() else "nope"], "--device"),
        (["--prompt", PROMPT, "--tokenizer", str(other_tokenizer)], "is not the tokenizer"),
    ]
    for argv, message in cases:
        assert main(["generate", *model, *argv]) == 2, argv
        err = capsys.readouterr().err  # at most a "loaded ..." line before the one error line
        lines = err.splitlines()
        assert lines[-1].startswith("error: ") and message in lines[-1] and len(lines) <= 2, (argv, err)
    assert _tree_digest(tiny_export.out) == before
