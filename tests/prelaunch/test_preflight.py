"""`ds-trhash preflight` through the real console script: one passing launch of the tiny config,
and every failure it exists for provoked once, each refused with exit 2 on the line of the
check that failed while nothing on disk changes.

The runs are independent processes, started side by side by tests/prelaunch/runs.py; each test
reads its own result."""
from __future__ import annotations

import pytest

# every case reads the session's runs (tests/prelaunch/runs.py), which launch the smoke
pytestmark = pytest.mark.e2e

CHECKS = ("config", "devices", "precision", "package deepspeed", "kernels", "deepspeed ops", "data", "output",
          "stage", "memory", "disk")


def _lines(proc) -> dict[str, list[tuple[str, str]]]:
    """check name -> [(PASS|WARN|FAIL, detail)] from the printed lines."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in proc.stdout.splitlines():
        mark, _, rest = line.partition("  ")
        if mark in ("PASS", "WARN", "FAIL"):
            name, _, detail = rest.partition(": ")
            out.setdefault(name, []).append((mark, detail))
    return out


def test_tiny_config_passes_every_check(prelaunch_runs):
    proc = prelaunch_runs["preflight"]["pass"]
    lines = _lines(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(CHECKS) <= set(lines), f"missing checks: {set(CHECKS) - set(lines)}\n{proc.stdout}"
    assert all(mark != "FAIL" for marks in lines.values() for mark, _ in marks), proc.stdout
    assert "1,024 tokens per optimizer step" in lines["config"][0][1]
    assert "60 steps" in lines["data"][0][1] and "every shard it reads matches" in lines["data"][0][1]
    assert "a fresh start" in lines["output"][0][1]
    assert "3 at once" in lines["disk"][0][1]  # tiny pretraining keeps its 3 token-pack checkpoints
    assert "Traceback" not in proc.stderr
    assert prelaunch_runs["unchanged"], "a preflight run changed files"


@pytest.mark.parametrize("case, check, needle", [
    ("missing_shard", "data", "topics_b/shard-00001.bin is missing"),
    ("wrong_hash", "data", "topics_a/shard-00000.bin has sha256"),
    ("target_tokens", "data", "TARGET_TOKENS 123456 != the plan's trained_tokens 160768"),
    ("disk", "disk", "0.0 MiB free under"),
    ("package", "package deepspeed", "simulated: deepspeed is not installed"),
    ("no_network", "data", "from the Hub at http://127.0.0.1:9 after "),
    ("wrong_tokenizer", "stage", "was trained with tokenizer"),
    ("pretraining_to_sft", "stage", "pretraining -> supervised-finetuning is not an allowed transition"),
    ("output_holds_run", "output", "already holds a run"),
])
def test_each_failure_is_refused_on_its_own_line(prelaunch_runs, case, check, needle):
    proc = prelaunch_runs["preflight"][case]
    lines = _lines(proc)
    failed = {name for name, marks in lines.items() for mark, _ in marks if mark == "FAIL"}
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert failed == {check}, f"failed: {failed}\n{proc.stdout}"
    assert any(needle in detail for mark, detail in lines[check] if mark == "FAIL"), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("fix the failed checks before launching")
    assert prelaunch_runs["unchanged"], "a refused preflight changed files"


def test_a_finished_run_under_resume_auto_passes_and_says_it_will_train_nothing(prelaunch_runs):
    proc = prelaunch_runs["preflight"]["finished_auto"]
    lines = _lines(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines["output"][0][0] == "PASS" and "holds this stage finished (step_00000004 is its last step)" in \
        lines["output"][0][1] and "exits 0" in lines["output"][0][1], proc.stdout


def test_the_launch_runs_the_cheap_part_itself(prelaunch_runs):
    """A launch on a disk that cannot hold one checkpoint is refused before the model, writing nothing."""
    proc = prelaunch_runs["full_disk_launch"]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot hold one checkpoint of 14.3 MiB" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not prelaunch_runs["launch_run"].exists() and prelaunch_runs["unchanged"]


def test_an_empty_output_dir_or_a_modifier_without_its_option_fails_the_config_or_output_check(tmp_path, capsys,
                                                                                              monkeypatch):
    """In-process (no console-script start): these fail before any device, data or disk check."""
    from ds_trhash.cli import main
    from tests.fail_closed import REPO, tree_digest

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "ds_configs" / "tiny" / "pretrain.yaml")
    assert main(["preflight", "--config", config, "--output-dir", ""]) == 2
    assert "FAIL  config: --output-dir: output_dir: is empty" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    before = tree_digest(tmp_path)
    from ds_trhash.prelaunch.preflight import _output
    from ds_trhash.prelaunch.preflight import Report
    from ds_trhash.training import config as tcfg
    from ds_trhash.training.entrypoint import build_arg_parser, launch_request

    for argv, needle in ((["--fork"], "--fork modifies --resume DIR"),
                         (["--output-dir", str(tmp_path / "file")], "is a regular file")):
        args = build_arg_parser().parse_args(["--config", config, *argv])
        cfg = tcfg.load_config(config, [f"output_dir={args.output_dir or tmp_path / 'run'}"])
        report = Report()
        assert _output(report, cfg, launch_request(args, environ={}), 1, None) is None
        assert report.checks[-1].failed and needle in report.checks[-1].detail
    assert tree_digest(tmp_path) == before
