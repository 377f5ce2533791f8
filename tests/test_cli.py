"""The single `ds-trhash` console script: its subcommand groups and exit codes."""

import pytest

from ds_trhash.cli import build_parser, main


def test_every_subcommand_group_is_registered():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"data", "sft", "eval", "export", "sync", "report", "generate", "demo"} <= set(sub.choices)


def test_a_command_runs_and_returns_its_exit_code(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["data", "fingerprint", str(missing)]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_a_refusal_is_one_line_from_the_one_handler_and_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    from ds_trhash.data import commands as data_commands
    from ds_trhash.release.hub import sync as hub

    # an OSError about a path the user named: one line, exit 2 (here --out lies below a regular file)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = main(["data", "embedded", "--out", str(blocker / "demo")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("ds-trhash data embedded: error: ")
    assert str(blocker) in err and not (blocker.parent / "demo").exists()

    # a token in any refusal is redacted by the handler; a SyncError lists its differences below
    monkeypatch.setattr(data_commands, "load_plan", lambda path: (_ for _ in ()).throw(
        data_commands.CommandError("the plan came with hf_abcdefghijklmnop in it")))
    assert main(["data", "fingerprint", str(tmp_path / "plan.json")]) == 2
    assert capsys.readouterr().err == "ds-trhash data fingerprint: error: the plan came with hf_<redacted> in it\n"
    monkeypatch.setattr(hub, "sync", lambda *a, **k: (_ for _ in ()).throw(
        hub.SyncError("verification failed for 1 file\n  a.bin: differs")))
    assert main(["sync", "--local", str(tmp_path), "--repo-id", "me/x", "--dry-run"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: verification failed for 1 file", "  a.bin: differs"]

    # anything else is a bug: it propagates with its traceback, also when it is a ValueError or an
    # OSError that names no file
    for bug in (ValueError("a bug"), OSError("a bug")):
        monkeypatch.setattr(data_commands, "load_plan", lambda path, bug=bug: (_ for _ in ()).throw(bug))
        with pytest.raises(type(bug), match="a bug"):
            main(["data", "fingerprint", str(tmp_path / "plan.json")])


def test_the_commands_that_only_read_files_start_without_torch(tmp_path):
    """A command line imports only its own command's module: `sync` (and so each pass of a
    watcher, a new process every --every seconds beside training), `cleanup`, `jobs`, `data` and
    `report` never import torch, here through the console script's own entry point in a fresh process."""
    import subprocess
    import sys

    code = f"""
import sys
from ds_trhash.cli import build_parser, main
for argv in (["sync", "--local", "x", "--repo-id", "me/x"], ["jobs", "status", "x.toml"], ["data", "fingerprint", "x"],
             ["report", "--run", "x", "--out", "y.json"]):
    build_parser(argv).parse_args(argv)
assert main(["cleanup", {str(tmp_path)!r}, "--dry-run"]) == 2  # no final/ yet: refused, after the imports it needs
assert main(["data", "fingerprint", {str(tmp_path / "missing.json")!r}]) == 2
print(sorted(m for m in ("torch", "deepspeed", "transformers") if m in sys.modules))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout + proc.stderr
    assert "error:" in proc.stderr  # the refusals were printed by the one handler


def test_help_lists_every_command_in_one_order():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == ["data", "sft", "eval", "export", "sync", "cleanup", "generate", "report", "jobs",
                                 "ops", "demo", "preflight", "smoke", "model"]
