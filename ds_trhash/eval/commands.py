"""`ds-trhash eval piqa` and `ds-trhash eval heldout`: score a checkpoint or an export.

Both run in one process (no torch.distributed). The model is rebuilt from the config the
checkpoint records (``trainer_state.json`` ``model_config`` of a training checkpoint,
``config.json`` of an export), or from ``--preset`` when it records none, and its weights
come from ``load_weights_only``. Every handler returns an exit code; expected failures raise a
``UserError``, which ``ds_trhash.cli`` prints as one ``error:`` line naming the subcommand (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from ds_trhash.argtypes import positive_int
from ds_trhash.checkpoints.stages import SourceRecord
from ds_trhash.checkpoints.weights import load_merged_weights
from ds_trhash.data.sft.dataset import SFTBatches, open_sft, pack
from ds_trhash.data.formats.tokenizer import load_tokenizer, tokenizer_sha256
from ds_trhash.errors import UserError
from ds_trhash.eval.heldout import heldout_loss
from ds_trhash.eval.piqa import PiqaCountWarning, evaluate_piqa, format_result, read_piqa
from ds_trhash.io import os_errors_as, read_json_object, sha256_file, write_json_atomic
from ds_trhash.model import TRHashConfig, TRHashForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EvalCommandError(UserError, ValueError):
    """Arguments or inputs the command cannot use."""


# --------------------------------------------------------------------------- model


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, EvalCommandError)


def recorded_model_config(checkpoint: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """(config dict, where it came from): trainer_state.json ``model_config`` of a training
    checkpoint, else an export's config.json; (None, None) when neither records one."""
    root = Path(checkpoint)
    state = root / "trainer_state.json"
    if state.is_file():
        config = _read_json(state).get("model_config")
        if isinstance(config, dict):
            return config, f"{state} model_config"
    config_file = root / "config.json"
    if config_file.is_file():
        return _read_json(config_file), str(config_file)
    return None, None


def check_is_checkpoint(checkpoint: str | os.PathLike) -> None:
    """``--checkpoint`` names a training checkpoint (trainer_state.json, state/) or an export
    (model.safetensors): say so when it is neither, before reading anything from it."""
    root = Path(checkpoint)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise EvalCommandError(f"--checkpoint {root} {what}; pass checkpoints/step_<N> of a run or an export directory")
    if not any((root / name).exists() for name in ("trainer_state.json", "state", "model.safetensors")):
        raise EvalCommandError(f"--checkpoint {root} is not a checkpoint or an export (it holds no trainer_state.json, "
                               "state/ or model.safetensors); pass checkpoints/step_<N> of a run or an export directory")


def resolve_config(checkpoint: str | os.PathLike, preset: str | None) -> tuple[TRHashConfig, str]:
    """TRHashConfig for ``checkpoint``: the recorded one wins; ``--preset`` is the fallback."""
    recorded, source = recorded_model_config(checkpoint)
    if recorded is not None and source is not None:  # found together
        if preset is not None:
            print(f"note: --preset {preset} ignored; the model config recorded in {source} is used", file=sys.stderr)
        return TRHashConfig.from_saved(recorded), source
    if preset is None:
        raise EvalCommandError(f"{checkpoint} records no model config (no trainer_state.json model_config, no "
                               "config.json); pass --preset tiny|200m")
    return TRHashConfig.from_preset(preset), f"--preset {preset}"


def load_model(checkpoint: str | os.PathLike,
               preset: str | None = None) -> tuple[TRHashForCausalLM, TRHashConfig, str, SourceRecord]:
    """(model in eval mode on CPU in fp32, config, config source, weights-only record)."""
    config, source = resolve_config(checkpoint, preset)
    state, record = load_merged_weights(checkpoint)
    model = TRHashForCausalLM(config)
    try:
        model.load_checkpoint_state(state, strict=True)
    except (RuntimeError, ValueError) as exc:
        first = " ".join(str(exc).split())[:400]
        raise EvalCommandError(f"the weights in {checkpoint} do not fit the model from {source}: {first}") from None
    model.float().eval()
    return model, config, source, record


def recorded_tokenizer_sha256(checkpoint: str | os.PathLike) -> str | None:
    """The tokenizer identity a checkpoint records: an export's copied tokenizer.json, or a
    training checkpoint's trainer_state.json ``tokenizer_sha256``; None when it records none."""
    root = Path(checkpoint)
    if (root / "tokenizer.json").is_file():
        return sha256_file(root / "tokenizer.json")
    if (root / "trainer_state.json").is_file():
        return _read_json(root / "trainer_state.json").get("tokenizer_sha256")
    return None


def recorded_packing_policy(checkpoint: str | os.PathLike) -> tuple[str | None, str | None]:
    """(policy, where) the checkpoint was trained with: a training checkpoint's
    ``training_critical["data.packing.policy"]``, an export's ``run.json`` ``packing_policy``."""
    root = Path(checkpoint)
    state = root / "trainer_state.json"
    if state.is_file():
        policy = (_read_json(state).get("training_critical") or {}).get("data.packing.policy")
        return (policy, f"{state} training_critical") if policy else (None, None)
    run = root / "run.json"
    if run.is_file():
        policy = _read_json(run).get("packing_policy")
        return (policy, str(run)) if policy else (None, None)
    return None, None


def _packing_policy(checkpoint: str | os.PathLike, explicit: str | None) -> tuple[str, str]:
    """The checkpoint's own policy unless one is given; a given one that differs is warned about
    (its loss is not comparable with the run's own held-out numbers)."""
    recorded, where = recorded_packing_policy(checkpoint)
    if explicit is None:
        if recorded is None:
            print(f"note: {checkpoint} records no packing policy; using cross_document", file=sys.stderr)
            return "cross_document", "default (the checkpoint records none)"
        return recorded, where or ""
    if recorded is not None and recorded != explicit:
        print(f"warning: --policy {explicit} differs from the {recorded} packing {checkpoint} was trained and "
              f"evaluated with ({where}); this loss is not comparable with the run's held-out loss", file=sys.stderr)
    return explicit, "--policy"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EvalCommandError("--device cuda: no CUDA device is available")
    return torch.device(name)


def _dtype(name: str, device: torch.device, cuda_default: str) -> str:
    if name == "auto":
        return cuda_default if device.type == "cuda" else "float32"
    if device.type == "cpu" and name != "float32":
        raise EvalCommandError(f"--dtype {name} on CPU: evaluation on CPU runs in float32")
    return name


def _place(model: TRHashForCausalLM, args: argparse.Namespace,
           cuda_default: str) -> tuple[TRHashForCausalLM, torch.device, str]:
    device = _device(args.device)
    dtype = _dtype(args.dtype, device, cuda_default)
    return model.to(device=device, dtype=DTYPES[dtype]), device, dtype


def _write_out(path: str | None, doc: dict[str, Any]) -> None:
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, doc)


# --------------------------------------------------------------------------- handlers


@os_errors_as(EvalCommandError)
def _piqa(args: argparse.Namespace) -> int:
    check_is_checkpoint(args.checkpoint)
    config, source = resolve_config(args.checkpoint, args.preset)
    if args.max_len is None:
        args.max_len = config.max_seq_len
    elif args.max_len > config.max_seq_len:  # checked before the model is allocated, as held-out does
        raise EvalCommandError(f"--max-len {args.max_len} exceeds the {config.max_seq_len} positions of the model "
                               f"({source}); pass --max-len {config.max_seq_len} or less (longer inputs are "
                               "left-truncated to it)")
    examples = read_piqa(args.data, args.labels)
    tokenizer = load_tokenizer(args.tokenizer)
    recorded = recorded_tokenizer_sha256(args.checkpoint)
    if recorded is not None and recorded != tokenizer_sha256(args.tokenizer):
        raise EvalCommandError(f"--tokenizer {args.tokenizer} is not the tokenizer {args.checkpoint} records "
                               f"(sha256 {recorded[:12]}); pass the model's own tokenizer")
    model, config, source, _record = load_model(args.checkpoint, args.preset)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise EvalCommandError(f"the tokenizer has {tokenizer.get_vocab_size()} entries, the model only "
                               f"{config.vocab_size}; pass the tokenizer the model was trained with")
    model, device, dtype = _place(model, args, cuda_default="float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PiqaCountWarning)  # printed below as one line
        result = evaluate_piqa(model, tokenizer, examples, max_len=args.max_len, batch_size=args.batch_size,
                               device=device, per_example=args.per_example)
    if result["warning"]:
        print(f"warning: {result['warning']}", file=sys.stderr)
    print(format_result(result))
    _write_out(args.out, {
        "task": "piqa", "checkpoint": str(args.checkpoint), "model_config_source": source,
        "tokenizer": str(args.tokenizer), "data": str(args.data), "data_sha256": sha256_file(args.data),
        "labels": str(args.labels) if args.labels else None, "device": str(device), "dtype": dtype,
        "batch_size": args.batch_size, **result})
    return 0


@os_errors_as(EvalCommandError)
def _heldout(args: argparse.Namespace) -> int:
    check_is_checkpoint(args.checkpoint)
    config, source = resolve_config(args.checkpoint, args.preset)
    sft_dir = Path(args.sft_dir)
    seq_len = args.seq_len
    if seq_len is None and (sft_dir / "manifest.json").is_file():
        seq_len = _read_json(sft_dir / "manifest.json").get("seq_len")
    seq_len = int(seq_len or config.max_seq_len)
    if seq_len > config.max_seq_len:  # checked before the model is allocated
        raise EvalCommandError(
            f"--seq-len {seq_len} exceeds the {config.max_seq_len} positions of the model ({source}); "
            f"pass --seq-len {config.max_seq_len} or less")
    model, config, source, _record = load_model(args.checkpoint, args.preset)
    tokenizer_hash = recorded_tokenizer_sha256(args.checkpoint)
    data = open_sft(sft_dir, expect_vocab=config.vocab_size, seq_len=seq_len, tokenizer_hash=tokenizer_hash)
    partition = data.partition("eval")
    policy, policy_source = _packing_policy(args.checkpoint, args.policy)
    packs = pack(partition, seq_len, policy)
    batches = SFTBatches(packs, args.micro_batch, world_size=1, rank=0, seed=0, drop_last=False)
    model, device, dtype = _place(model, args, cuda_default="float32")
    result = heldout_loss(model, batches.epoch(0), device)
    print(f"held-out loss {result['eval_loss']:.6f} (PPL {result['eval_ppl']:.2f}) over "
          f"{result['eval_tokens']} supervised tokens, {len(partition)} examples in {len(packs)} windows "
          f"({policy} packing)")
    _write_out(args.out, {
        "task": "heldout", "checkpoint": str(args.checkpoint), "model_config_source": source,
        "sft_dir": str(sft_dir), "seq_len": seq_len, "policy": policy, "policy_source": policy_source, "micro_batch": args.micro_batch,
        "examples": len(partition), "windows": len(packs), "tokenizer_checked": tokenizer_hash is not None,
        "device": str(device), "dtype": dtype, **result})
    return 0




def _model_options(p: argparse.ArgumentParser, dtype_help: str) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="checkpoints/step_<N> of a run, or an export directory (model.safetensors)")
    p.add_argument("--preset", choices=("tiny", "200m"), default=None,
                   help="model shape when the checkpoint records no config")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help=dtype_help)
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON")


def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the ``eval`` command group to the ``ds-trhash`` CLI."""
    group = subparsers.add_parser("eval", help="evaluate a checkpoint: held-out loss, PIQA")
    sub = group.add_subparsers(dest="eval_command", required=True, metavar="COMMAND")

    p = sub.add_parser("piqa", help="zero-shot PIQA acc / acc_norm (docs/contracts.md §8)")
    _model_options(p, "auto: float32 on CPU, float16 on CUDA (the release protocol); CPU is always float32")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="directory holding tokenizer.json, or the file")
    p.add_argument("--data", required=True, metavar="PIQA.jsonl", help="JSONL with goal, sol1, sol2, label")
    p.add_argument("--labels", metavar="FILE", help="labels file (valid-labels.lst), one 0/1 per line")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="model inputs at most (default and maximum: the model's positions); longer inputs lose "
                        "their oldest context tokens")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--per-example", action="store_true", help="include every example's scores in --out")
    p.set_defaults(func=_piqa, error_label=p.prog)

    p = sub.add_parser("heldout", help="held-out loss over the packed eval partition of an SFT set (docs/contracts.md §8)")
    _model_options(p, "auto: float32")
    p.add_argument("--sft-dir", required=True, metavar="DIR", help="tokenized SFT set (manifest.json, eval/)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="packing window (default: the set's sequence cap)")
    p.add_argument("--micro-batch", type=positive_int, default=16)
    p.add_argument("--policy", choices=("cross_document", "per_document"), default=None,
                   help="packing policy (default: the one the checkpoint was trained with; a different one warns)")
    p.set_defaults(func=_heldout, error_label=p.prog)
    return group
