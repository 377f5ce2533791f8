"""PIQA zero-shot accuracy (docs/contracts.md §8).

Protocol, exactly as published:

- every example (goal, sol1, sol2, label) asks which of two continuations fits the goal;
- the context is the goal, the continuation is ``" " + solution``; no BOS token and no chat
  template; context and continuation are tokenized separately and concatenated, so no token
  straddles the boundary;
- the token sequence is left-truncated so that the model reads at most ``max_len`` tokens
  (the last continuation token is only ever a target, so at most ``max_len + 1`` tokens are
  kept); the continuation is always kept whole and the oldest context tokens are dropped;
- a continuation's score is the summed log-probability of its tokens, each given everything
  before it; ``acc`` takes the argmax of the summed score, ``acc_norm`` the argmax of the mean
  log-probability per continuation token; ties go to the first solution.

The published numbers are over the 1,838-example validation split; a different count is
reported (and warned about) but not refused, so small local sets stay usable.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, cast

import torch

from ds_trhash.errors import UserError
from ds_trhash.io import utf8_lines


PIQA_VALIDATION_SIZE = 1838
PAD_ID = 1  # docs/contracts.md §5 <pad>; right padding is never attended to by a real token (causal mask)
FIELDS = ("goal", "sol1", "sol2")


class PiqaDataError(UserError, ValueError):
    """The PIQA input cannot be used; the message names the file and line."""


class PiqaCountWarning(UserWarning):
    """The set is not the full 1,838-example validation split."""


@dataclass(frozen=True)
class PiqaExample:
    goal: str
    sol1: str
    sol2: str
    label: int


@dataclass(frozen=True)
class Request:
    """One scored continuation: ``ids`` = kept context tokens + all continuation tokens."""

    ids: tuple[int, ...]
    continuation_tokens: int
    dropped_context_tokens: int = 0


# --------------------------------------------------------------------------- input


def _parse_label(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise PiqaDataError(f"{where}: label must be 0 or 1, got {value!r}")
    if isinstance(value, int) and value in (0, 1):
        return value
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value.strip())
    raise PiqaDataError(f"{where}: label must be 0 or 1, got {value!r}")


def read_labels(path: str | os.PathLike) -> list[int]:
    """The original distribution's ``valid-labels.lst``: one 0/1 per line."""
    labels = []
    for lineno, line in enumerate(utf8_lines(path, PiqaDataError), 1):
        if line.strip():
            labels.append(_parse_label(line, f"{path}:{lineno}"))
    return labels


def read_piqa(path: str | os.PathLike, labels_path: str | os.PathLike | None = None) -> list[PiqaExample]:
    """Read PIQA JSONL (``goal``, ``sol1``, ``sol2``, ``label``; extra fields such as ``id`` are
    ignored). With ``labels_path`` the labels come from that file, line by line, and a label
    also present in the JSONL must agree with it. Blank lines are skipped."""
    labels = read_labels(labels_path) if labels_path is not None else None
    examples: list[PiqaExample] = []
    with contextlib.closing(utf8_lines(path, PiqaDataError)) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PiqaDataError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise PiqaDataError(f"{where}: expected a JSON object with {', '.join(FIELDS)}, label")
            for name in FIELDS:
                if name not in record:
                    raise PiqaDataError(f"{where}: missing field {name!r}")
                if not isinstance(record[name], str):
                    raise PiqaDataError(f"{where}: field {name!r} must be a string, got {type(record[name]).__name__}")
            if not record["goal"]:
                raise PiqaDataError(f"{where}: field 'goal' is empty; the goal is the scoring context")
            if labels is None:
                if "label" not in record:
                    raise PiqaDataError(f"{where}: missing field 'label' (or pass the labels file)")
                label = _parse_label(record["label"], where)
            else:
                if len(examples) >= len(labels):
                    raise PiqaDataError(f"{where}: {labels_path} has only {len(labels)} labels")
                label = labels[len(examples)]
                if "label" in record and _parse_label(record["label"], where) != label:
                    raise PiqaDataError(f"{where}: label {record['label']!r} disagrees with {labels_path} ({label})")
            examples.append(PiqaExample(record["goal"], record["sol1"], record["sol2"], label))
    if labels is not None and len(labels) != len(examples):
        raise PiqaDataError(f"{labels_path} has {len(labels)} labels for {len(examples)} examples in {path}")
    if not examples:
        raise PiqaDataError(f"{path} holds no examples")
    return examples


# --------------------------------------------------------------------------- requests


class TextEncoder(Protocol):
    """A tokenizer: ``tokenizers.Tokenizer`` (an ``Encoding`` with ``ids``) or a transformers one
    (a list of ids)."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> object: ...


def _encode(tokenizer: TextEncoder, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added (no BOS, whatever the tokenizer's
    post-processor says)."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return [int(i) for i in cast(Iterable[int], getattr(encoded, "ids", encoded))]


def build_request(tokenizer: TextEncoder, context: str, continuation: str, max_len: int) -> Request:
    """Tokenize separately, concatenate, left-truncate to ``max_len`` model inputs."""
    if max_len < 1:
        raise ValueError(f"max_len must be positive, got {max_len}")
    ctx = _encode(tokenizer, context)
    cont = _encode(tokenizer, continuation)
    if not ctx:
        raise PiqaDataError(f"context {context!r} tokenizes to nothing; the first continuation token needs a context")
    if not cont:
        raise PiqaDataError(f"continuation {continuation!r} tokenizes to nothing")
    if len(cont) > max_len:
        raise PiqaDataError(f"a continuation of {len(cont)} tokens cannot be scored whole within max_len {max_len}")
    keep_ctx = min(len(ctx), max_len + 1 - len(cont))
    return Request(tuple(ctx[len(ctx) - keep_ctx:] + cont), len(cont), len(ctx) - keep_ctx)


def piqa_requests(tokenizer: TextEncoder, example: PiqaExample, max_len: int) -> tuple[Request, Request]:
    return (build_request(tokenizer, example.goal, " " + example.sol1, max_len),
            build_request(tokenizer, example.goal, " " + example.sol2, max_len))


# --------------------------------------------------------------------------- scoring


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def score_requests(model: torch.nn.Module, requests: Sequence[Request], batch_size: int = 16,
                   device: torch.device | str | None = None) -> list[float]:
    """Summed continuation log-probability of every request, in input order.

    Requests are batched longest first (little padding), right-padded with <pad> = 1; the
    model's logits at padded positions are never read. Log-softmax runs in fp32 whatever the
    model's dtype.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    device = torch.device(device) if device is not None else _model_device(model)
    was_training = model.training
    model.eval()
    scores = [0.0] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].ids))
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            width = max(len(requests[i].ids) for i in chunk) - 1
            inputs = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)
            targets = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for row, i in enumerate(chunk):
                ids = torch.tensor(requests[i].ids, dtype=torch.long)
                n = len(ids) - 1
                inputs[row, :n] = ids[:-1]
                targets[row, :n] = ids[1:]
                mask[row, n - requests[i].continuation_tokens:n] = True
            logits = model(inputs.to(device))
            mask = mask.to(device)
            picked = logits[mask].float().log_softmax(dim=-1)  # [continuation tokens, V]
            token_lp = picked.gather(1, targets.to(device)[mask].unsqueeze(1)).squeeze(1).double().cpu()
            counts = mask.sum(dim=1).tolist()
            for row, part in enumerate(token_lp.split(counts)):
                scores[chunk[row]] = float(part.sum())
    finally:
        if was_training:
            model.train()
    return scores


def _argmax(values: Sequence[float]) -> int:
    """First index of the largest value (ties go to the first solution)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def count_warning(n: int) -> str | None:
    if n == PIQA_VALIDATION_SIZE:
        return None
    return (f"scored {n} PIQA examples, the validation split has {PIQA_VALIDATION_SIZE}; "
            "these numbers are not comparable with the published ones")


def evaluate_piqa(model: torch.nn.Module, tokenizer: TextEncoder, examples: Iterable[PiqaExample], max_len: int = 2048, batch_size: int = 16,
                  device: torch.device | str | None = None, per_example: bool = False) -> dict[str, Any]:
    """Zero-shot PIQA: ``{"acc", "acc_norm", "n", "expected_n", "warning", "truncated"[, "per_example"]}``.

    ``model(input_ids)`` must return logits [B, T, V]; the model is used in the dtype and on the
    device it already has (``device`` defaults to its parameters'), and is left in the mode it
    was in. ``truncated`` counts examples whose context lost tokens to ``max_len``.
    """
    examples = list(examples)
    if not examples:
        raise PiqaDataError("no PIQA examples to score")
    requests = [r for ex in examples for r in piqa_requests(tokenizer, ex, max_len)]
    sums = score_requests(model, requests, batch_size=batch_size, device=device)
    correct = correct_norm = truncated = 0
    rows = []
    for k, ex in enumerate(examples):
        pair = requests[2 * k:2 * k + 2]
        total = sums[2 * k:2 * k + 2]
        mean = [s / r.continuation_tokens for s, r in zip(total, pair)]
        pred, pred_norm = _argmax(total), _argmax(mean)
        correct += pred == ex.label
        correct_norm += pred_norm == ex.label
        cut = any(r.dropped_context_tokens for r in pair)
        truncated += cut
        if per_example:
            rows.append({"index": k, "label": ex.label, "pred": pred, "pred_norm": pred_norm,
                         "sum_logprob": total, "mean_logprob": mean,
                         "continuation_tokens": [r.continuation_tokens for r in pair], "truncated": cut})
    n = len(examples)
    warning = count_warning(n)
    if warning:
        warnings.warn(warning, PiqaCountWarning, stacklevel=2)
    result: dict[str, Any] = {"acc": correct / n, "acc_norm": correct_norm / n, "n": n,
                              "expected_n": PIQA_VALIDATION_SIZE, "warning": warning, "truncated": truncated,
                              "max_len": max_len}
    if per_example:
        result["per_example"] = rows
    return result


def format_result(result: dict[str, Any]) -> str:
    """One line: acc / acc_norm in percent, as docs/contracts.md §8 publishes them."""
    return (f"PIQA acc {100 * result['acc']:.2f} / acc_norm {100 * result['acc_norm']:.2f} "
            f"({result['n']} examples, expected {result['expected_n']}; {result['truncated']} truncated)")


__all__ = ["PIQA_VALIDATION_SIZE", "PAD_ID", "PiqaDataError", "PiqaCountWarning", "PiqaExample", "Request",
           "read_labels", "read_piqa", "build_request", "piqa_requests", "score_requests", "evaluate_piqa",
           "count_warning", "format_result"]
