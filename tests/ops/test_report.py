"""`ds-trhash report` over the demo's three stages (run under supervisord by the shared
fixture): PNG plots that are not blank and have the expected size, an index.html that names
every stage and references only files that exist; a run in progress; a folder that is no run."""
import re
import shutil

import numpy as np
import pytest
from matplotlib.image import imread

from ds_trhash.report.plots import DPI, HEIGHT_IN, WIDTH_IN
from tests.ops.conftest import cli
from tests.ops.test_manifest import tree_hash

pytestmark = pytest.mark.e2e
STAGES = ("pretraining", "refinement", "supervised-finetuning")


def _images(html: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', html)


def test_report_of_three_stages_has_plots_and_facts(supervised, tmp_path):
    root = supervised["root"]
    out = tmp_path / "report"
    proc = cli("report", "--run", str(root / "pre"), "--run", str(root / "refine"), "--run", str(root / "sft"),
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    html = (out / "index.html").read_text()
    for stage in STAGES:
        assert html.count(stage) >= 3, stage  # stage list, facts column, plot legends' note
        assert any((out / "records").glob(f"*-{stage}/run_record.json")), stage
    images = _images(html)
    assert {"plots/loss.png", "plots/lr.png", "plots/tokens_per_s.png", "plots/expert_load.png",
            "plots/expert_balance.png"} <= set(images)
    for src in images:
        pixels = imread(out / src)
        assert pixels.shape[:2] == (int(HEIGHT_IN * DPI), int(WIDTH_IN * DPI)), src
        assert pixels[..., :3].std() > 0.05, f"{src} looks blank"
    header = (root / "pre" / "metrics.csv").read_text().splitlines()[0].split(",")
    if "grad_norm" not in header:  # runs from before the grad_norm column
        assert "plots/grad_norm.png" not in images and "not recorded by pretraining" in html
    assert "Per-expert token load per layer" in html and "Busiest expert per layer" in html
    busiest = re.search(r"<td>busiest expert \(whole stage\)</td>(.*?)</tr>", html).group(1)
    assert busiest.count("x an even split") == 3, busiest  # every stage recorded its routes
    assert html.count("<code>finished</code>") == 3  # state of each stage
    assert "plan_unique_core" in html and "sft_manifest_sha256" in html  # facts from each stage's run record


def test_report_of_a_run_in_progress(supervised, tmp_path):
    """A live run: metrics.csv ends in a half-written row and the last checkpoint does not exist yet."""
    run = tmp_path / "live"
    shutil.copytree(supervised["root"] / "refine", run, ignore=shutil.ignore_patterns("shard_cache"))
    shutil.rmtree(run / "checkpoints" / "step_00000002")
    metrics = run / "metrics.csv"
    text = metrics.read_text()
    metrics.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + "2,0.1,6.1")  # a torn last row
    out = tmp_path / "report"
    proc = cli("report", "--run", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    html = (out / "index.html").read_text()
    assert "in progress" in html and "refinement" in html
    assert all((out / src).is_file() for src in _images(html)) and "plots/loss.png" in _images(html)


def test_a_run_from_before_expert_load_csv_is_reported_as_not_recorded(supervised, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(supervised["root"] / "refine", run, ignore=shutil.ignore_patterns("shard_cache", "expert_load.csv"))
    out = tmp_path / "report"
    proc = cli("report", "--run", str(supervised["root"] / "pre"), "--run", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    html = (out / "index.html").read_text()
    assert "Per-expert token load: not recorded by refinement" in html
    assert "plots/expert_load.png" in _images(html)  # pretraining's map is still drawn


def test_a_folder_that_is_not_a_run_exits_2_and_writes_nothing(supervised, tmp_path):
    (tmp_path / "notes").mkdir()
    out = tmp_path / "report"
    before = tree_hash(tmp_path)
    proc = cli("report", "--run", str(supervised["root"] / "pre"), "--run", str(tmp_path / "notes"), "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{tmp_path / 'notes'} is not a run output directory" in proc.stderr
    assert tree_hash(tmp_path) == before
