"""The publishable run record (docs/contracts.md §10): ``run_record.json`` plus a short ``run_record.md``.

Every field either comes from the run's own files (trainer_state.json of its checkpoints,
metrics.csv, the export manifest, the tokenizer, the plan / SFT manifest) or is passed in
explicitly. A field nobody can vouch for stays ``null`` and is named in ``unknown``: the
record never guesses. ``provenance`` says where each known value came from.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_trhash import checkpoints as ckpt
from ds_trhash.batch_layout import step_rows, step_tokens
from ds_trhash.checkpoints import MANIFEST, list_checkpoints, verify
from ds_trhash.io import sha256_file, write_json_atomic
from ds_trhash.release.export.manifest import EXPORT_MANIFEST, TOKENIZER
from ds_trhash.release.record.run_files import (RecordError, checkpoint_metrics, git_commit, number, read_json,
                                                read_metrics, read_piqa_rows)
from ds_trhash.checkpoints.selection import RULES as SELECTION_RULES
from ds_trhash.checkpoints.selection import Candidate, choose

RECORD_FORMAT = "ds-trhash-run-record-v1"
RECORD_FIELDS = (
    "framework_commit", "stage", "source_checkpoint", "source_checkpoint_hash", "dataset_revision", "data_fingerprint",
    "tokenizer_hash", "model_mode", "optimizer_schedule", "world_size", "hardware", "precision",
    "effective_batch", "kernel_path", "checkpoints", "piqa", "selection_rule", "selected_checkpoint",
    "export_safetensors_sha256", "known_limitations",
)
# Written when the run records them, never listed as unknown: a run of an older trainer has none.
# model: the whole architecture (trainer_state.json model_config), the same fields as config.json's.
OPTIONAL_FIELDS = ("model",)


def _source_hash(path: str | None) -> tuple[str | None, str | None]:
    """A checkpoint is identified by the SHA-256 of its MANIFEST.json, an export by its weights."""
    if not path:
        return None, None

    src = Path(path)
    if (src / MANIFEST).is_file():
        return sha256_file(src / MANIFEST), f"SHA-256 of {src / MANIFEST}"
    export = read_json(src / EXPORT_MANIFEST)
    if export and "weights" in export:
        return export["weights"]["sha256"], f"weights SHA-256 in {src / EXPORT_MANIFEST}"
    return None, None


def _dataset_revision(state: Mapping[str, Any]) -> tuple[Any, str | None]:
    plan = state.get("plan_doc")
    if isinstance(plan, Mapping) and plan.get("revision"):
        found = {"dataset": plan.get("dataset"), "revision": plan["revision"]}
        source = state.get("data_source")
        if isinstance(source, Mapping) and source.get("commit"):  # the commit the run read
            found.update(store=source.get("store"), commit=source["commit"])
            return found, "plan_doc and data_source in trainer_state.json"
        return found, "plan_doc in trainer_state.json"
    sft_dir = state.get("sft_dir") or (state.get("training_critical") or {}).get("data.sft_dir")
    if sft_dir:
        manifest = read_json(Path(sft_dir) / "manifest.json")
        if manifest:
            revisions = sorted({str(s.get("revision")) for s in manifest.get("sources", []) if s.get("revision")})
            if revisions:
                return {"sft_set": sft_dir, "revisions": revisions}, f"{sft_dir}/manifest.json"
    return None, None


def _data_fingerprint(state: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The identity of the exact training data: the plan's unique-core fingerprint, or the
    SHA-256 of the SFT set's manifest (which pins every partition file's hash)."""
    if state.get("plan_fingerprint"):
        return {"plan_unique_core": state["plan_fingerprint"]}, "plan_fingerprint in trainer_state.json"
    sft_dir = state.get("sft_dir") or (state.get("training_critical") or {}).get("data.sft_dir")
    if sft_dir and (Path(sft_dir) / "manifest.json").is_file():
        return {"sft_manifest_sha256": sha256_file(Path(sft_dir) / "manifest.json")}, f"{sft_dir}/manifest.json"
    return None, None


def _tokenizer_hash(state: Mapping[str, Any], export: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    if export and export.get("tokenizer"):
        return export["tokenizer"], "export_manifest.json"
    tok = state.get("tokenizer_dir")
    if tok:
        file = Path(tok) / TOKENIZER if Path(tok).is_dir() else Path(tok)
        if file.is_file():
            return sha256_file(file), f"SHA-256 of {file}"
    return None, None


def _select(checkpoints: list[dict[str, Any]], rule: str) -> str | None:
    """The trainer's own selection rule (checkpoints.selection) over the recorded checkpoints."""

    candidates = [Candidate(epoch=c.get("epoch"), step=c["step"], checkpoint=c["name"],
                            eval_loss=c["metrics"].get("eval_loss"), eval_ppl=None, eval_tokens=None,
                            train_loss=c["metrics"].get("train_loss")) for c in checkpoints]
    try:
        return choose(candidates, rule).checkpoint
    except ValueError:  # nothing to choose from: the field stays unknown
        return None


# --------------------------------------------------------------------------- collection


class _Fields:
    """The record's known fields and, for each, where it came from (absent values stay out)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.prov: dict[str, str] = {}

    def put(self, name: str, value: object, source: str | None) -> None:
        if value is not None:
            self.fields[name], self.prov[name] = value, source or "run files"


def _check_run_dir(run: Path) -> None:
    if not run.is_dir():
        raise RecordError(f"{run} is not a run output directory (it does not exist or is no directory); "
                          "pass the --output-dir of a training launch")
    if not any((run / name).exists() for name in ("config.json", "metrics.csv", "checkpoints")):
        raise RecordError(f"{run} is not a run output directory (it holds no config.json, metrics.csv or "
                          "checkpoints/); pass the --output-dir of a training launch")


def _checkpoint_entries(run: Path, rows: list[dict[str, str]],
                        piqa: dict[int, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one entry per checkpoint, the trainer states of the complete ones, oldest first)."""
    checkpoints, states, unreadable = [], [], []
    for info in list_checkpoints(run):
        state = read_json(info.path / "trainer_state.json")
        if state is None:
            unreadable.append(info.name)
        state = state or {}
        complete = verify(info.path, deep=False)[0]
        metrics = checkpoint_metrics(info.step, rows)
        if info.step in piqa:
            metrics.update(piqa_acc=piqa[info.step]["acc"], piqa_acc_norm=piqa[info.step]["acc_norm"])
        checkpoints.append({"name": info.name, "step": info.step, "complete": complete,
                            "epoch": state.get("epoch"), "backends_used": state.get("backends_used"),
                            "metrics": metrics})
        if complete:
            states.append(state)
    if checkpoints and len(unreadable) == len(checkpoints):
        raise RecordError(f"{run}: the trainer_state.json of every checkpoint is missing or unreadable "
                          f"({', '.join(unreadable[-3:])}); a record built without them would say nothing: "
                          "restore them, or report on the run's copy that has them")
    return checkpoints, states


def _effective_batch(crit: Mapping[str, Any], world: int | None) -> dict[str, Any] | None:
    micro, accum = crit.get("batch.micro_batch"), crit.get("batch.grad_accum")
    if micro is None or accum is None or world is None:
        return None
    seq_len = crit.get("data.seq_len")
    return {"sequences": step_rows(micro, accum, world), "micro_batch": micro, "grad_accum": accum,
            "world_size": world, "tokens": step_tokens(micro, accum, world, seq_len) if seq_len else None}


def _state_fields(out: _Fields, state: Mapping[str, Any], where: str) -> None:
    """What the newest complete checkpoint's trainer_state.json says about the run."""
    crit = state.get("training_critical") or {}
    out.put("framework_commit", state.get("framework_commit"), where)
    out.put("stage", state.get("stage"), where)
    out.put("source_checkpoint", state.get("init_checkpoint"), where)
    out.put("source_checkpoint_hash", *_source_hash(state.get("init_checkpoint")))
    out.put("dataset_revision", *_dataset_revision(state))
    out.put("data_fingerprint", *_data_fingerprint(state))
    if "lora" in state:
        out.put("model_mode", "LoRA" if state["lora"] else "full", where)
    schedule = {k: v for k, v in crit.items() if k.startswith(("optimizer.", "schedule."))}
    if schedule:
        schedule["total_steps"] = state.get("total_steps")
        schedule["planned_steps"] = state.get("planned_steps")
        schedule["capped"] = ckpt.capped_by(state)
        out.put("optimizer_schedule", schedule, where)
    out.put("world_size", state.get("world_size"), where)
    out.put("model", state.get("model_config"), where)
    out.put("hardware", state.get("hardware"), where)
    out.put("precision", crit.get("precision"), where)
    out.put("effective_batch", _effective_batch(crit, state.get("world_size")), where)


def _kernel_path(out: _Fields, checkpoints: list[dict[str, Any]]) -> None:
    used = [c["backends_used"] for c in checkpoints if c["complete"] and c["backends_used"]]
    if used:
        distinct = [dict(b) for b in {json.dumps(b, sort_keys=True): b for b in used}.values()]
        out.put("kernel_path", distinct[0] if len(distinct) == 1 else distinct,
                "backends_used recorded at run time in trainer_state.json (not the configured policy)")


def _selection_fields(out: _Fields, run: Path, checkpoints: list[dict[str, Any]], selection_rule: str | None) -> None:
    chosen = read_json(run / "selection.json")
    if selection_rule is None and chosen and chosen.get("rule") in SELECTION_RULES:
        # the rule the run itself applied when it wrote best/
        out.put("selection_rule", chosen["rule"], f"{run}/selection.json")
        out.put("selected_checkpoint", {**chosen["selected"], "published_as": "best/"}, f"{run}/selection.json")
    elif selection_rule is not None:
        if selection_rule not in SELECTION_RULES:
            raise RecordError(f"selection rule {selection_rule!r} is not computable here; allowed: "
                              f"{list(SELECTION_RULES)} (or pass selected_checkpoint with your own rule text)")
        out.put("selection_rule", selection_rule, "given")
        out.put("selected_checkpoint", _select([c for c in checkpoints if c["complete"]], selection_rule),
                f"computed by rule {selection_rule!r} over the complete checkpoints")


def collect_run_fields(run_dir: str | os.PathLike, *, export_dir: str | os.PathLike | None = None,
                       selection_rule: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(fields, provenance) read from a run output directory; absent facts are left out."""
    run = Path(run_dir)
    _check_run_dir(run)
    out = _Fields()
    rows = read_metrics(run / "metrics.csv")
    piqa = read_piqa_rows(run / "piqa.jsonl")
    checkpoints, states = _checkpoint_entries(run, rows, piqa)
    if checkpoints:
        out.put("checkpoints", checkpoints, "checkpoints/*/trainer_state.json, metrics.csv and piqa.jsonl")
    names = {c["step"]: c["name"] for c in checkpoints}
    if piqa:
        out.put("piqa", [{**row, "checkpoint": names.get(step, "source" if step == 0 else None)}
                         for step, row in sorted(piqa.items())], f"{run}/piqa.jsonl (written by the trainer)")
    state = states[-1] if states else {}
    _state_fields(out, state, "trainer_state.json of the newest complete checkpoint")
    _kernel_path(out, checkpoints)
    export = None
    if export_dir is not None:
        export = read_json(Path(export_dir) / EXPORT_MANIFEST)
        if export is None:
            raise RecordError(f"{export_dir} has no readable {EXPORT_MANIFEST}; is it a complete export?")
        out.put("export_safetensors_sha256", export["weights"]["sha256"], f"{export_dir}/{EXPORT_MANIFEST}")
    out.put("tokenizer_hash", *_tokenizer_hash(state, export))
    _selection_fields(out, run, checkpoints, selection_rule)
    return out.fields, out.prov


# --------------------------------------------------------------------------- writing


def build_run_record(*, run_dir: str | os.PathLike | None = None, export_dir: str | os.PathLike | None = None,
                     **fields: object) -> dict[str, Any]:
    """The record document; explicit ``fields`` override what is read from ``run_dir``."""
    unknown_names = sorted(set(fields) - set(RECORD_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown_names:
        raise RecordError(f"unknown run record fields {unknown_names}; allowed: {list(RECORD_FIELDS)}")
    collected: dict[str, Any] = {}
    prov: dict[str, str] = {}
    if run_dir is not None:
        rule = fields.get("selection_rule")
        collected, prov = collect_run_fields(run_dir, export_dir=export_dir,
                                             selection_rule=rule if isinstance(rule, str) and rule in SELECTION_RULES else None)
    for name, value in fields.items():
        if value is not None:
            collected[name], prov[name] = value, "given"
    limitations = list(collected.get("known_limitations") or [])
    if "framework_commit" not in collected:
        commit = git_commit()
        if commit:
            collected["framework_commit"] = commit
            prov["framework_commit"] = "git rev-parse HEAD where the record was written (the run recorded none)"
            limitations.append("framework commit is the checkout that wrote this record; the run did not record one")
    if "hardware" not in collected:
        from ds_trhash.checkpoints.hardware import describe_hardware  # loads torch: only for a run that recorded none

        collected["hardware"] = describe_hardware()
        prov["hardware"] = "detected on the machine that wrote this record (the run recorded none)"
        limitations.append("hardware was detected where this record was written, not recorded by the run")
    schedule = collected.get("optimizer_schedule")
    if isinstance(schedule, Mapping) and schedule.get("capped"):
        limitations.append(f"the stage was {schedule['capped']}")
    if "selection_rule" in collected and "selected_checkpoint" not in collected:
        limitations.append("no checkpoint satisfies the selection rule (no eval metrics?)")
    collected["known_limitations"] = limitations
    prov.setdefault("known_limitations", "given and derived while writing the record")
    doc: dict[str, Any] = {"format": RECORD_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for name in RECORD_FIELDS:
        doc[name] = collected.get(name)
    doc.update({name: collected[name] for name in OPTIONAL_FIELDS if collected.get(name) is not None})
    doc["unknown"] = [name for name in RECORD_FIELDS if doc[name] is None]
    doc["provenance"] = {name: prov[name] for name in (*RECORD_FIELDS, *OPTIONAL_FIELDS)
                         if doc.get(name) is not None and name in prov}
    return doc


def render_markdown(doc: Mapping[str, Any]) -> str:
    def show(value: object) -> str:
        if value is None:
            return "**unknown**"
        if isinstance(value, (dict, list)):
            return "`" + json.dumps(value, sort_keys=True) + "`"
        return f"`{value}`"

    lines = ["# Run record", ""]
    for name in (*RECORD_FIELDS, *(n for n in OPTIONAL_FIELDS if n in doc)):
        if name in ("checkpoints", "known_limitations"):
            continue
        lines.append(f"- **{name.replace('_', ' ')}**: {show(doc.get(name))}")
    lines += ["", "## Checkpoints", ""]
    ckpts = doc.get("checkpoints")
    if not ckpts:
        lines.append("**unknown** (no checkpoints found)")
    else:
        lines += ["| checkpoint | step | epoch | complete | train loss | eval loss | eval ppl | PIQA acc | "
                  "PIQA acc_norm |", "|---|---|---|---|---|---|---|---|---|"]
        for c in ckpts:
            m = c.get("metrics", {})
            cell = [str(m.get(k, "")) for k in ("train_loss", "eval_loss", "eval_ppl", "piqa_acc", "piqa_acc_norm")]
            mark = " (selected)" if c["name"] == _selected_name(doc.get("selected_checkpoint")) else ""
            lines.append(f"| {c['name']}{mark} | {c['step']} | {c.get('epoch', '')} | {c['complete']} | "
                         + " | ".join(cell) + " |")
    lines += ["", "## PIQA", ""]
    if not doc.get("piqa"):
        lines.append("**unknown** (the run wrote no piqa.jsonl)")
    else:
        lines += ["| step | epoch | checkpoint | acc | acc_norm | examples |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['epoch']} | {r['checkpoint'] or ''} | {r['acc']} | {r['acc_norm']} | {r['n']} |"
                  for r in doc["piqa"]]
    lines += ["", "## Known limitations", ""]
    lines += [f"- {item}" for item in doc.get("known_limitations") or []] or ["- none recorded"]
    lines += ["", "## Unknown", ""]
    lines += [f"- {name}" for name in doc.get("unknown") or []] or ["- nothing: every field is known"]
    return "\n".join(lines) + "\n"


def _selected_name(selected: object) -> str | None:
    """``selected_checkpoint`` is a name (computed or given) or the run's selection.json entry."""
    if isinstance(selected, Mapping):
        return Path(str(selected.get("checkpoint", ""))).name or None
    return None if selected is None else str(selected)


def write_run_record(path: str | os.PathLike, *, run_dir: str | os.PathLike | None = None,
                     export_dir: str | os.PathLike | None = None, **fields: object) -> dict[str, Any]:
    """Write ``path`` (JSON) and ``run_record.md`` beside it; return the record."""
    doc = build_run_record(run_dir=run_dir, export_dir=export_dir, **fields)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, doc)
    (out.parent / "run_record.md").write_text(render_markdown(doc), encoding="utf-8")
    return doc


def is_run_record(path: str | os.PathLike) -> bool:
    """True for a file an earlier ``write_run_record`` wrote (a JSON object of this format)."""
    doc = read_json(Path(path))
    return doc is not None and doc.get("format") == RECORD_FORMAT
