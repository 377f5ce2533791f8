"""Every command block of the README, as written (issue 33): the CPU commands run in a fresh folder
in README order through bash with the installed `ds-trhash`; training launches are checked, not
started, and what cannot run here is skipped with the reason (each one named below).

- `ds-trhash ...`, `python -c ...` and the shell lines (a hostfile written) run as written. The
  data block makes its own inputs (its first two lines); the report and cleanup commands need
  runs/pre, runs/ref and runs/sft: small finished runs built in-process stand in for them
  (tests/release/run_fixtures.py), since their launches cost more than this suite can spend.
- Commands that load a model (`generate`, `export`) or start launches (`smoke`, `jobs`) are
  skipped here: other tests run them (SKIPPED names which).
- `deepspeed ... launch/train.py ARGS` and `torchrun ... launch/train.py ARGS` lines (a launch
  costs 10-20 CPU s each) are checked by parsing: the launcher part with DeepSpeed's own runner
  parser (torchrun's with torch.distributed.run's), ARGS with the trainer's argparse and config
  loader (every --set validated like the file). The launches themselves run in tests/training/
  (the same configs, the same flags).
- `ds-trhash ops slurm ... --submit` needs a SLURM cluster's `sbatch`: skipped (the same command
  without --submit runs; tests/prelaunch/ runs the script it writes).

The command blocks of docs/*.md are checked by parsing only (nothing runs): their `deepspeed` and
`torchrun` lines as above, their `ds-trhash` lines through the console script's own argparse, their bare `--set`
overrides through the config loader.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from ds_trhash.checkpoints import list_checkpoints
from tests.fail_closed import REPO, VENV_BIN
from tests.release.run_fixtures import make_run

# (pattern, why the command is not run here); every other command runs
SKIPPED = [
    (r"^make ", "make runs the suite or the demo itself"),
    (r"--hf-dataset", "reads a dataset from the Hugging Face Hub (network)"),
    (r" \.\.\. ", "an elided example: `...` stands for arguments shown above"),
    (r"^HF_TOKEN=\.\.\. ds-trhash sync", "the real Hub: tests/release/hub/test_sync.py and test_watch.py sync against the "
                                         "loopback stand-in"),
    (r"^ds-trhash (smoke|jobs) ", "starts training launches: tests/prelaunch/test_smoke.py and tests/ops/"),
    (r"^ds-trhash (generate|export) ", "loads a model (torch and transformers, 10-20 s a command on the test machine): "
                                       "tests/release/test_generate.py, test_export_command.py and "
                                       "tests/checkpoints/test_run_source.py run them, `generate --model RUN` included"),
    (r"^ds-trhash preflight ", "tests/prelaunch/test_preflight.py runs it on this config"),
    (r"^ds-trhash ops slurm .*--submit", "submits a job to a SLURM cluster (sbatch): tests/prelaunch/test_slurm.py submits "
                                         "through an sbatch stand-in, tests/prelaunch/test_slurm_launch.py runs the script"),
]
LAUNCH = re.compile(r"^(HF_TOKEN=\S+ )?(deepspeed|torchrun) ")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[str]:
    """Logical commands: continued lines joined, a heredoc kept whole, a transcript's `$ ` lines only."""
    lines = block.splitlines()
    transcript = any(line.startswith("$ ") for line in lines)
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if transcript:
            if not line.startswith("$ "):
                continue  # the output shown
            line = line[2:]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        heredoc = re.search(r"<<'(\w+)'", line)
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                line += "\n" + lines[i]
                i += 1
            line += "\n" + heredoc.group(1)
            i += 1
        out.append(line)
    return out


def _skip_reason(command: str) -> str | None:
    return next((why for pattern, why in SKIPPED if re.search(pattern, command)), None)


@pytest.fixture(scope="module")
def readme_commands():
    return [c for block in _blocks((REPO / "README.md").read_text(encoding="utf-8")) for c in _commands(block)]


def test_the_readme_blocks_are_read_whole(readme_commands):
    """The extraction sees every block: a change that hides commands from this test fails here."""
    assert len(_blocks((REPO / "README.md").read_text(encoding="utf-8"))) >= 9
    assert sum(bool(LAUNCH.match(c)) for c in readme_commands) >= 10
    assert sum(c.startswith("ds-trhash ") for c in readme_commands) >= 25


def _stand_in_runs(root: Path, tokenizer_dir: Path) -> None:
    for name in ("pre", "ref"):
        make_run(root / "runs" / name, packs={10: 1})
    make_run(root / "runs" / "sft", packs={10: 1}, tokenizer=tokenizer_dir)  # the record's tokenizer hash
    shutil.copytree(root / "runs" / "sft" / "checkpoints" / "step_00000030", root / "runs" / "sft" / "best")


def _check_launch(argv: list[str], cwd: Path, launcher: str = "deepspeed") -> None:
    """The launcher's own parser for its part (DeepSpeed's runner, or torchrun's), the trainer's
    parser and config loader for the rest."""
    from ds_trhash.training.entrypoint import build_arg_parser, config_from_args

    if launcher == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(argv)
        script, user_args = parsed.training_script, parsed.training_script_args
    else:
        from deepspeed.launcher.runner import parse_args as runner_args

        parsed = runner_args(argv)
        script, user_args = parsed.user_script, parsed.user_args
    assert script == "launch/train.py", argv
    args = build_arg_parser().parse_args(user_args)
    old = os.getcwd()
    os.chdir(cwd)  # --config and paths are relative to the folder the README runs in
    try:
        config_from_args(args)
    finally:
        os.chdir(old)


def test_every_cpu_command_block_runs_as_written(readme_commands, tmp_path, tokenizer_dir):
    work = tmp_path / "readme"
    work.mkdir()
    for name in ("ds_configs", "launch"):  # "run these from the repository root": its configs, nothing else
        (work / name).symlink_to(REPO / name)
    _stand_in_runs(work, tokenizer_dir)
    record = work / ".launches.jsonl"
    script = ["set -euo pipefail"]
    for name in ("deepspeed", "torchrun"):  # each launch recorded as [launcher, args...], not started
        script.append(f'{name}() {{ "{VENV_BIN / "python"}" -c \'import json, sys; open(sys.argv[1], "a").write('
                      f'json.dumps(sys.argv[2:]) + "\\n")\' "{record}" {name} "$@"; }}')
    ran, skipped = [], []
    for command in readme_commands:
        why = _skip_reason(command)
        if why is not None:
            skipped.append((command, why))
            continue
        ran.append(command)
        script.append(command)
    script.append("wait")
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    env.pop("HF_TOKEN", None)
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    launches = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(launches) == sum(bool(LAUNCH.match(c)) for c in ran)
    for launcher, *argv in launches:
        _check_launch(argv, work, launcher)
    # what the blocks promise, seen in their output
    assert (work / "pre_fixed.json").is_file() and (work / "sft" / "manifest.json").is_file()
    assert json.loads((work / "runs" / "sft" / "run_record.json").read_text())["tokenizer_hash"]
    assert (work / "runs" / "report" / "index.html").is_file()
    assert [c.step for c in list_checkpoints(work / "runs" / "pre")] == [10]  # cleanup --keep packs
    assert "#SBATCH --nodes=2" in (work / "runs" / "slurm-tiny" / "slurm" / "job.sbatch").read_text()
    assert {why for _, why in skipped} == {why for _, why in SKIPPED}  # every reason still applies to some command


# Shell variables the docs' commands use, with a value each (docs/operations.md's Slurm array task)
DOC_SHELL_VARS = {"SLURM_ARRAY_TASK_ID": "0"}


def _docs_commands() -> list[tuple[str, str]]:
    return [(path.name, command) for path in sorted((REPO / "docs").glob("*.md"))
            for block in _blocks(path.read_text(encoding="utf-8")) for command in _commands(block)]


def test_every_docs_command_parses(monkeypatch):
    """Each command of a docs/*.md bash block as the shell splits it: a `deepspeed` line through
    `_check_launch`; a `ds-trhash` line through the console script's parser (its subcommand, every
    flag and each argument's form), a preflight or smoke line's config loaded as its launch would;
    a bare `--set KEY=VALUE` (docs/configs.md) one shell word, validated on the tiny SFT config."""
    from ds_trhash.cli import build_parser
    from ds_trhash.training.config import load_config
    from ds_trhash.training.entrypoint import config_from_args

    monkeypatch.chdir(REPO)  # the docs run from the repository root
    checked = {"deepspeed": 0, "torchrun": 0, "ds-trhash": 0, "--set": 0}
    for doc, command in _docs_commands():
        line = re.sub(r"\$\{(\w+)\}", lambda m: DOC_SHELL_VARS[m[1]], command)
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # HF_TOKEN=... before the command
            words.pop(0)
        kind = words[0]
        if kind == "export":
            assert len(words) == 2 and "=" in words[1], f"{doc}: {command}"
            continue
        assert kind in checked, f"{doc}: {command}: no check for this kind of command here; add one"
        checked[kind] += 1
        try:
            if kind in ("deepspeed", "torchrun"):
                _check_launch(words[1:], REPO, kind)
            elif kind == "--set":
                assert len(words) == 2, f"{doc}: {command}: the shell splits the value into {words[1:]}"
                load_config("ds_configs/tiny/sft.yaml", [words[1]])
            else:
                args = build_parser(words[1:]).parse_args(words[1:])
                if args.command in ("preflight", "smoke"):
                    config_from_args(args)
        except SystemExit as e:  # argparse's refusal (its message is on the captured stderr)
            pytest.fail(f"{doc}: {command}: refused by the parser (exit {e.code})")
    assert checked["deepspeed"] >= 5 and checked["torchrun"] >= 2 and checked["ds-trhash"] >= 20, checked
    assert checked["--set"] >= 8, checked
