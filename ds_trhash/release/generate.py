"""`ds-trhash generate`: text from an export or a training checkpoint, streamed as it comes.

Both kinds of model directory run the same transformers model (``release/hf/modeling_tr_hash_moe``)
and transformers' ``generate`` with its KV cache, so what this prints is what a user of the
export gets from ``AutoModelForCausalLM``:

- an export (``config.json`` with ``model_type: tr_hash_moe``) loads with ``from_pretrained`` and
  its own tokenizer files;
- a training checkpoint (or an export written before the Hugging Face files existed) loads its
  weights through the checkpoint weights loader (LoRA adapters merged) into a model built from
  the recorded config; the tokenizer is the one the run recorded, checked against its SHA-256.

Greedy unless ``--temperature`` > 0; sampling is reproducible with ``--seed``. ``--chat`` /
``--messages`` render the complexity-chat-v2 template and generate the assistant turn.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ds_trhash.checkpoints import TRAINER_STATE, CheckpointError, read_trainer_state
from ds_trhash.checkpoints.run_source import is_run_dir, model_of_run
from ds_trhash.checkpoints.weights import load_merged_weights
from ds_trhash.argtypes import nonnegative_float
from ds_trhash.argtypes import seed as seed_arg
from ds_trhash.data.sft.chat import CHAT_TEMPLATE_JINJA, ChatError, normalize
from ds_trhash.data.formats.tokenizer import TokenizerError, tokenizer_file, tokenizer_sha256
from ds_trhash.errors import UserError
from ds_trhash.io import os_errors_as, read_json_object
from ds_trhash.model.attention import rope_inv_freq
from ds_trhash.model.config import TRHashConfig as NativeConfig
from ds_trhash.release.hf.bundle import SPECIAL_TOKENS, hf_config

if TYPE_CHECKING:  # transformers (seconds to import) is imported where a model is loaded
    from transformers import PreTrainedTokenizerFast

    from ds_trhash.release.hf.modeling_tr_hash_moe import TRHashForCausalLM as HFModel


class GenerateError(UserError, ValueError):
    """A model directory or request that cannot be served; the message says how to fix it."""


@dataclass
class Loaded:
    model: HFModel  # the export's model class, loaded through transformers
    tokenizer: PreTrainedTokenizerFast
    source: str  # how it was loaded, for the log line


# --------------------------------------------------------------------------- loading


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, GenerateError)


def _hf_tokenizer(tokenizer_json: Path, max_len: int) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast over a run's tokenizer.json, set up as an export's would be."""
    from transformers import PreTrainedTokenizerFast  # lazy: transformers (seconds), as in load()


    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), model_max_length=max_len,
                                   chat_template=CHAT_TEMPLATE_JINJA, clean_up_tokenization_spaces=False,
                                   **SPECIAL_TOKENS)


def _load_export(root: Path) -> Loaded:
    # PreTrainedTokenizerFast directly: transformers 5's AutoTokenizer reads config.json first and
    # would ask whether to trust the export's code just to build a tokenizer.
    # lazy: transformers (seconds), as in load(); the export's model code imports it at its top
    from transformers import PreTrainedTokenizerFast

    from ds_trhash.release.hf.modeling_tr_hash_moe import TRHashForCausalLM

    if not (root / "tokenizer.json").is_file():
        raise GenerateError(f"{root} has no tokenizer.json (its run set no data.tokenizer); pass --tokenizer DIR "
                            "with the run's tokenizer, or export again with --tokenizer DIR")
    model = TRHashForCausalLM.from_pretrained(str(root)).float()  # no dtype argument: 4.x and 5.x differ
    return Loaded(model, PreTrainedTokenizerFast.from_pretrained(str(root)), f"export {root} (transformers)")


def _recorded(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model config as TRHashConfig.to_dict, trainer state or {}) of a checkpoint or an old export."""
    try:
        state = read_trainer_state(root) if (root / TRAINER_STATE).is_file() else {}
    except CheckpointError as exc:
        raise GenerateError(str(exc)) from None
    config = state.get("model_config")
    if not isinstance(config, dict) and (root / "config.json").is_file():
        config = _read_json(root / "config.json")
    if not isinstance(config, dict):
        raise GenerateError(f"{root} records no model config (no trainer_state.json model_config, no config.json); "
                            "point --model at checkpoints/step_<N>, best/ or an export directory")
    return config, state


def _tokenizer_path(root: Path, state: dict[str, Any], override: str | None) -> Path:
    where = override or ((root / "tokenizer.json") if (root / "tokenizer.json").is_file() else state.get("tokenizer_dir"))
    if where is None:
        raise GenerateError(f"{root} records no tokenizer; pass --tokenizer DIR")
    try:
        path = tokenizer_file(where)
    except TokenizerError as exc:
        raise GenerateError(f"{exc} (the tokenizer recorded for {root}); pass --tokenizer DIR") from None
    expected, where_recorded = state.get("tokenizer_sha256"), "trainer_state.json tokenizer_sha256"
    if not expected and (root / "run.json").is_file():  # an export: the tokenizer its run recorded
        expected, where_recorded = _read_json(root / "run.json").get("tokenizer_sha256"), "run.json tokenizer_sha256"
    if not expected and override and (root / "tokenizer.json").is_file():
        expected, where_recorded = tokenizer_sha256(root / "tokenizer.json"), f"{root / 'tokenizer.json'}"
    if expected and tokenizer_sha256(path) != expected:
        raise GenerateError(f"--tokenizer {path} is not the tokenizer {root} was trained with (SHA-256 differs from "
                            f"{where_recorded}); pass the model's own tokenizer with --tokenizer, or drop --tokenizer")
    return path


def _load_checkpoint(root: Path, tokenizer_override: str | None) -> Loaded:
    # lazy: the export's model code imports transformers (seconds) at its top, as in load()
    from ds_trhash.release.hf.configuration_tr_hash_moe import TRHashConfig
    from ds_trhash.release.hf.modeling_tr_hash_moe import TRHashForCausalLM
    config, state = _recorded(root)
    try:
        native = NativeConfig.from_saved(config)
        weights, _record = load_merged_weights(root)
    except (CheckpointError, ValueError, TypeError) as exc:
        raise GenerateError(f"cannot load {root}: {exc}") from None
    tok = _tokenizer_path(root, state, tokenizer_override)
    doc = {k: v for k, v in hf_config(native.to_dict()).items() if k not in ("model_type", "auto_map")}
    model = TRHashForCausalLM(TRHashConfig(**doc))
    inv_freq = rope_inv_freq(native.head_dim, native.rope_theta)
    weights = {k: (v.float() if v.is_floating_point() else v) for k, v in weights.items()}
    weights.update({f"layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq for i in range(native.num_layers)})
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise GenerateError(f"the weights in {root} do not fit its recorded model config: "
                            f"{' '.join(str(exc).split())[:300]}") from None
    step = state.get("step")
    kind = f"checkpoint {root}" + (f" (step {step})" if step is not None else "")
    return Loaded(model, _hf_tokenizer(tok, native.max_seq_len), kind)


def load(model_dir: str | os.PathLike, tokenizer: str | None = None, device: str = "cpu") -> Loaded:
    # lazy: transformers takes seconds to import; only a generation needs it (the argument checks do not)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "loaded ..." line says it; no bars in the terminal

    try:
        target = torch.device(device)
    except RuntimeError:
        raise GenerateError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA device is available")
    root = Path(model_dir)
    if not root.is_dir():
        raise GenerateError(f"--model {root} is not a directory; pass an export or checkpoints/step_<N> (or best/)")
    if is_run_dir(root):  # a run's output directory: its final checkpoint, or final/ after cleanup
        try:
            root = model_of_run(root, "--model", lambda line: print(line, file=sys.stderr, flush=True))
        except CheckpointError as exc:
            raise GenerateError(str(exc)) from None
    config = root / "config.json"
    is_export = config.is_file() and _read_json(config).get("model_type") == "tr_hash_moe"
    if is_export and tokenizer is None:
        loaded = _load_export(root)
    else:
        loaded = _load_checkpoint(root, tokenizer)
    cast(torch.nn.Module, loaded.model).to(target).eval()  # transformers types its own .to oddly
    return loaded


# --------------------------------------------------------------------------- prompting


def read_messages(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A conversation file: a JSON list of {role, content} or {"messages": [...]} (the SFT source form)."""
    file = Path(path)
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GenerateError(f"--messages {file} does not exist") from None
    except json.JSONDecodeError as exc:
        raise GenerateError(f"--messages {file} is not valid JSON ({exc})") from None
    messages = doc.get("messages") if isinstance(doc, dict) else doc
    if not isinstance(messages, list):
        raise GenerateError(f"--messages {file} must hold a list of {{role, content}} or {{\"messages\": [...]}}")
    return messages


def check_conversation(messages: list[dict[str, Any]]) -> None:
    """What the SFT builder would refuse, with its messages, plus a conversation that is already answered."""
    try:
        turns = normalize(messages)
    except ChatError as exc:
        raise GenerateError(f"the conversation cannot be rendered: {exc}") from None
    if not turns:
        raise GenerateError("the conversation has no non-empty message")
    if turns[-1].role == "assistant":
        raise GenerateError("the conversation ends with an assistant turn; end it with a user turn to generate a reply")


def chat_prompt(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]]) -> str:
    """The template's rendering up to and including the generation prompt "Assistant:\\n"."""
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))  # tokenize=False: text


# --------------------------------------------------------------------------- generation


@dataclass
class Result:
    prompt_tokens: int
    new_ids: list[int]
    stopped_at_eos: bool
    seconds: float


def generate(loaded: Loaded, text: str, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, stream: bool = True) -> Result:
    """Generate after ``text`` with the KV cache; tokens are printed to stdout as they come."""
    from transformers import TextStreamer  # lazy: transformers (seconds), as in load()

    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    limit = model.config.max_position_embeddings
    if ids.shape[1] == 0:
        raise GenerateError("the prompt is empty; give some text")
    if ids.shape[1] + max_new_tokens > limit:
        raise GenerateError(f"the prompt ({ids.shape[1]} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                            f"model's context of {limit} tokens; shorten the prompt or ask for fewer tokens")
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    if seed is not None:
        torch.manual_seed(seed)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if stream else None
    eos = model.config.eos_token_id
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=model.config.pad_token_id, use_cache=True,
                             streamer=streamer, **sampling)
    new = out[0, ids.shape[1]:].tolist()
    return Result(ids.shape[1], new, bool(new) and new[-1] == eos, time.perf_counter() - started)


@os_errors_as(GenerateError)
def run(args: argparse.Namespace) -> int:
    """The CLI handler; argument checks come before any heavy import so user errors are quick."""
    if args.prompt == "":
        raise GenerateError("--prompt is empty; give some text to continue")
    if args.max_new_tokens < 1:
        raise GenerateError("--max-new-tokens must be at least 1")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.system is not None and args.chat is None:
        raise GenerateError("--system goes with --chat (a --messages file carries its own system turn)")
    if args.messages is not None:
        messages = read_messages(args.messages)
    elif args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
    else:
        messages = None
    if messages is not None:
        check_conversation(messages)
    # stdout carries only the generated text: libraries' loading chatter goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        loaded = load(args.model, args.tokenizer, args.device)
    text = chat_prompt(loaded.tokenizer, messages) if messages is not None else args.prompt
    print(f"loaded {loaded.source}", file=sys.stderr, flush=True)
    result = generate(loaded, text, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, seed=args.seed)
    why = "stopped at EOS" if result.stopped_at_eos else f"reached --max-new-tokens {args.max_new_tokens}"
    rate = len(result.new_ids) / result.seconds if result.seconds > 0 else float("inf")
    print(f"[{len(result.new_ids)} new tokens after a {result.prompt_tokens}-token prompt, {why}; "
          f"{rate:.1f} tokens/s]", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="generate text from an export or a checkpoint (streams to stdout)")
    gen.add_argument("--model", required=True,
                     help="export directory, checkpoints/step_<N>, best/, or a run directory (its final checkpoint, "
                          "or final/ after cleanup)")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw text to continue")
    what.add_argument("--chat", help="a user message; the chat template is applied and the reply generated")
    what.add_argument("--messages", help="JSON file with a conversation ending in a user turn")
    gen.add_argument("--system", default=None, help="system prompt for --chat")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling")
    gen.add_argument("--seed", type=seed_arg, default=None, help="seed for sampling (reproducible output)")
    gen.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's own / recorded)")
    gen.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    gen.set_defaults(func=run)
