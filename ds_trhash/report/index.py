"""``ds-trhash report --run DIR [--run DIR ...] --out OUT``: a report directory.

OUT receives ``index.html`` (key facts per stage, then the plots), ``plots/*.png`` and one run
record per stage under ``records/<n>-<stage>/`` (the same JSON + Markdown the single-run form
writes). Every run folder is checked before anything is written; the page is written last, so
an ``index.html`` that exists refers only to files that exist.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jinja2

from ds_trhash.io import json_text, write_text_atomic
from ds_trhash.release.record.writer import build_run_record, render_markdown
from ds_trhash.report import expert_plots
from ds_trhash.report.plots import PLOTS, colour, has_data, render_plot
from ds_trhash.report.series import StageSeries, read_stages
from ds_trhash.training.records.files import EXPERT_LOAD_FILE

INDEX = "index.html"
NOT_RECORDED = "not recorded"

TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>body{font-family:sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;font-size:90%}
th{background:#f4f4f4}.note{color:#555}code{font-size:90%}</style></head>
<body>
<h1>{{ title }}</h1>
<p>Stages, in order: {% for s in stages %}<span style="color:{{ s.colour }}">{{ s.name }}</span>{{ ", " if not loop.last }}{% endfor %}.</p>
<h2>Key facts</h2>
<table><tr><th>fact</th>{% for s in stages %}<th style="color:{{ s.colour }}">{{ s.name }}</th>{% endfor %}</tr>
{% for fact, cells in facts %}<tr><td>{{ fact }}</td>{% for cell in cells %}<td><code>{{ cell }}</code></td>{% endfor %}</tr>
{% endfor %}</table>
<h2>Plots</h2>
{% for p in plots %}<h3>{{ p.title }}</h3>
{% if p.file %}<img src="{{ p.file }}" alt="{{ p.title }}" width="900" height="400">{% endif %}
{% for note in p.notes %}<p class="note">{{ note }}</p>{% endfor %}
{% endfor %}
</body></html>
""")


def _show(value: object) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _last(series: StageSeries, column: str) -> str:
    values = series.values[column]
    if not series.recorded[column]:
        return NOT_RECORDED
    return f"{values[-1]:.6g}" if values else "none yet"


def facts(stages: list[StageSeries], records: list[dict]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("run directory", [str(s.run_dir) for s in stages]),
        ("state", [s.state for s in stages]),
        ("steps (this stage)", [f"{s.last_step} of {s.total_steps or 'unknown'}" for s in stages]),
        ("newest checkpoint step", [_show(s.newest_checkpoint) for s in stages]),
        ("tokens seen", [_last(s, "tokens_seen") for s in stages]),
        ("last train loss", [_last(s, "train_loss") for s in stages]),
        ("last eval loss", [_last(s, "eval_loss") for s in stages]),
        ("last grad norm", [_last(s, "grad_norm") for s in stages]),
        ("busiest expert (whole stage)", [expert_plots.busiest(s) for s in stages]),
    ]
    for name in ("framework_commit", "world_size", "precision", "effective_batch", "kernel_path", "model_mode",
                 "data_fingerprint", "tokenizer_hash", "source_checkpoint", "selection_rule", "selected_checkpoint",
                 "export_safetensors_sha256"):
        rows.append((name.replace("_", " "), [_show(r.get(name)) for r in records]))
    rows.append(("unknown fields", [", ".join(r["unknown"]) or "none" for r in records]))
    return rows


def _plot_entries(stages: list[StageSeries], plots_dir: Path) -> list[dict]:
    entries = []
    for plot in PLOTS:
        missing = [s.stage for s in stages if not any(s.recorded[c] for c in plot.columns)]
        notes = [f"{plot.title}: {NOT_RECORDED} by {', '.join(missing)} (no {'/'.join(plot.columns)} column "
                 "in metrics.csv)."] if missing else []
        file = None
        if has_data(plot, stages):
            file = render_plot(plot, stages, plots_dir).relative_to(plots_dir.parent).as_posix()
        elif not missing:
            notes.append(f"{plot.title}: no values logged yet.")
        entries.append({"title": plot.title, "file": file, "notes": notes})
    return entries + _expert_entries(stages, plots_dir)


def _expert_entries(stages: list[StageSeries], plots_dir: Path) -> list[dict]:
    missing = [s.stage for s in stages if s.expert_load is None]
    notes = [f"Per-expert token load: {NOT_RECORDED} by {', '.join(missing)} (no complete row in "
             f"{EXPERT_LOAD_FILE} yet, or a run from before the trainer wrote it)."] if missing else []
    entries = []
    for title, render in ((expert_plots.LOAD_TITLE, expert_plots.render_load_maps),
                          (expert_plots.BALANCE_TITLE, expert_plots.render_balance)):
        file = None
        if expert_plots.with_load(stages):
            file = render(stages, plots_dir).relative_to(plots_dir.parent).as_posix()
        entries.append({"title": title, "file": file, "notes": notes})
    return entries


def write_report(runs: list[Path], out: Path, *, last_fields: dict[str, Any] | None = None,
                 export_dir: Path | None = None) -> Path:
    """Write the report directory; ``last_fields``/``export_dir`` go to the last stage's record."""
    stages = read_stages(runs)
    records = []
    for i, run in enumerate(runs):
        last = i == len(runs) - 1
        records.append(build_run_record(run_dir=run, export_dir=export_dir if last else None,
                                        **((last_fields or {}) if last else {})))
    plots_dir = out / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    for i, (series, doc) in enumerate(zip(stages, records, strict=True), 1):
        folder = out / "records" / f"{i}-{series.stage}"
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / "run_record.json", json_text(doc))
        write_text_atomic(folder / "run_record.md", render_markdown(doc))
    page = TEMPLATE.render(
        title="Training report: " + " \u2192 ".join(s.stage for s in stages),
        stages=[{"name": s.stage, "colour": colour(i)} for i, s in enumerate(stages)],
        facts=facts(stages, records), plots=_plot_entries(stages, plots_dir))
    write_text_atomic(out / INDEX, page)
    return out / INDEX


def is_directory_output(out: str | os.PathLike, runs: int) -> bool:
    """The single-run form writes ``OUT`` as a JSON file; several runs or a non-.json OUT make a directory."""
    return runs > 1 or not str(out).endswith(".json")
