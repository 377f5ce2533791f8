"""`ds-trhash sync --watch` against the stand-in Hub through the real client: bad input refused
before anything is uploaded, a stalled pass killed and the next one completing under a prefix,
a checkpoint still being written left alone, and `kill -9` of the watcher at any point followed
by a restart leaving the Hub and the run directory consistent. The watched training launch is
in test_lifecycle_launch.py."""
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from ds_trhash import cli
from ds_trhash.checkpoints import MANIFEST, list_checkpoints
from ds_trhash.checkpoints.sync_guard import read_verified
from ds_trhash.io import sha256_file
from ds_trhash.ops.manifest import load_manifest
from ds_trhash.ops.render import render_config
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub import watch
from ds_trhash.release.lifecycle.final import COMPLETE_FILE, FINAL_DIR
from tests import fail_closed
from tests.release.run_fixtures import copy_run, make_run, tree_digest

REPO = "me/run"
PREFIX = "runs/pretrain"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("watch") / "run")


def _consistent(run: Path, prefix: str = PREFIX) -> list[str]:
    """Every unit recorded as verified matches the Hub file for file, and every complete unit on
    disk is recorded: what a restarted watcher and cleanup rely on."""
    plan = hub.discover(run)
    records = read_verified(run)
    problems = []
    api = hub.make_api()
    for unit in plan.units:
        unit.prefix = prefix
        manifest = unit.files[MANIFEST if unit.kind == "checkpoint" else "export_manifest.json"]["sha256"]
        entry = records.get(unit.name)
        if entry is None or entry["manifest_sha256"] != manifest or entry.get("prefix", "") != prefix:
            problems.append(f"{unit.name}: not recorded as verified ({entry})")
        problems += hub.remote_differences(api, REPO, unit)
    return problems


def test_bad_input_is_refused_before_anything_is_uploaded(tmp_path, finished, server, capsys, monkeypatch):
    run = copy_run(finished, tmp_path / "run")
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "todo.txt").write_text("not a run")
    before = {p: fail_closed.tree_digest(p) for p in (run, stray)}
    cases = [
        (["--watch", run, "--repo", "me/missing"], "repository me/missing does not exist on the Hub"),
        (["--watch", run, "--repo", "not a valid id!!"], "is not a Hub repository id"),
        (["--watch", run, "--repo", REPO, "--create-repo", "--path-in-repo", "/abs"], "--path-in-repo '/abs'"),
        (["--watch", run, "--repo", REPO, "--create-repo", "--path-in-repo", "a/../b"], "no '.' or '..' part"),
        (["--watch", stray, "--repo", REPO, "--create-repo"], "is not a run output directory"),
        (["--watch", run, "--repo", REPO, "--every", "0"], "--every must be a positive number"),
        (["--watch", run, "--local", run, "--repo", REPO], "either --local DIR"),
        (["--watch", run, "--repo", REPO, "--prune-local"], "--watch never prunes"),
    ]
    for args, needle in cases:
        assert cli.main(["sync", *map(str, args)]) == 2, args
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (args, err)
    monkeypatch.delenv("HF_TOKEN")
    assert cli.main(["sync", "--watch", str(run), "--repo", REPO, "--create-repo"]) == 2
    assert "HF_TOKEN is not set" in capsys.readouterr().err
    assert server.repos == {} and server.counts.get("commit") is None
    assert {p: fail_closed.tree_digest(p) for p in (run, stray)} == before


def test_a_stalled_pass_is_killed_and_the_next_one_completes_under_the_prefix(tmp_path, server):
    # a run that syncs and asks for cleanup: the watcher deletes the checkpoints once it verified them
    run = make_run(tmp_path / "run", keep_unsynced=True, cleanup="keep_final")
    gate = server.hold["commit"] = threading.Event()  # the Hub takes the first commit and never answers
    lines, result = [], {}

    def watcher():
        result["code"] = watch.watch(run, REPO, prefix=PREFIX, every=0.5, pass_timeout=20, create_repo=True,
                                     log=lines.append)

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    try:
        assert server.arrived.setdefault("commit", threading.Event()).wait(120), lines
        deadline = time.monotonic() + 60
        while not any("stalled" in line for line in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.1)
        assert read_verified(run) == {}  # nothing verified by the killed pass
    finally:
        server.hold.pop("commit")
        gate.set()
    thread.join(180)
    assert result.get("code") == 0, lines
    assert any("pass 1 stalled: no result after 20s; killed it" in line for line in lines)
    files = server.repo(REPO).files
    assert all(path.startswith(PREFIX + "/") for path in files), sorted(files)
    assert f"{PREFIX}/{FINAL_DIR}/model.safetensors" in files
    assert {p.split("/")[3] for p in files if p.startswith(f"{PREFIX}/checkpoints/")} == {
        "step_00000010", "step_00000020", "step_00000030"}
    assert any("cleanup after success (keep_final): removed 3 checkpoint(s)" in line for line in lines), lines
    assert list_checkpoints(run) == [] and _consistent(run) == []  # final/ stays, verified


def test_a_checkpoint_being_written_is_not_uploaded_and_the_watch_goes_on(tmp_path, server):
    run = make_run(tmp_path / "run", steps=(10, 20), finished=False)
    partial = run / "checkpoints" / "step_00000025"  # published name, manifest not yet written
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "mp_rank_00_model_states.pt").write_bytes(b"half-written")
    (run / "checkpoints" / "step_00000030.tmp").mkdir()  # DeepSpeed still writing into the temp dir
    lines = []
    assert watch.watch(run, REPO, every=0.2, pass_timeout=120, create_repo=True, log=lines.append,
                       max_passes=1) == 1  # the stage has not completed: a bounded watch ends unfinished
    files = server.repo(REPO).files
    assert {p.split("/")[1] for p in files} == {"step_00000010", "step_00000020"}, sorted(files)
    assert not (run / COMPLETE_FILE).exists() and _consistent(run, prefix="") == []


def _watcher(run: Path) -> subprocess.Popen:
    return subprocess.Popen([str(fail_closed.VENV_BIN / "ds-trhash"), "sync", "--watch", str(run), "--repo", REPO,
                             "--path-in-repo", PREFIX, "--every", "0.3", "--pass-timeout", "120", "--create-repo"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _passes_of(run: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "--local" in (p.info["cmdline"] or []) and str(run) in (p.info["cmdline"] or [])]


def _kill9(proc: subprocess.Popen, run: Path) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _passes_of(run):  # the pass in flight dies with its watcher (PR_SET_PDEATHSIG)
        assert time.monotonic() < deadline, "a sync pass outlived its killed watcher"
        time.sleep(0.1)


def test_kill_9_of_the_watcher_at_any_point_then_a_restart_is_consistent(tmp_path, finished, server):
    run = copy_run(finished, tmp_path / "run")
    before = {k: v for k, v in tree_digest(run).items() if not k.startswith("sync_verified")}
    # 1: killed in the middle of its first commit (the Hub may or may not apply it)
    gate = server.hold["commit"] = threading.Event()
    first = _watcher(run)
    assert server.arrived.setdefault("commit", threading.Event()).wait(120), "the watcher never committed"
    _kill9(first, run)
    server.hold.pop("commit")
    gate.set()
    # 2: killed right after a later unit's commit was answered, before it was recorded
    commits = server.counts.get("commit", 0)
    second = _watcher(run)
    killed = threading.Event()
    # (the verification listing that follows an answered commit: the unit is on the Hub, not yet recorded)
    server.observers.append(lambda name: name == "tree" and server.counts.get("commit", 0) > commits
                            and not killed.is_set() and (killed.set(), os.kill(second.pid, signal.SIGKILL)))
    second.wait(180)
    assert killed.is_set(), second.stdout.read()
    _kill9(second, run)
    server.observers.clear()
    # 3: the restart finishes the backup; nothing of the run changed on the way
    third = _watcher(run)
    out, _ = third.communicate(timeout=300)
    assert third.returncode == 0, out
    assert "every checkpoint and final/ is verified" in out
    assert _consistent(run) == []
    assert {k: v for k, v in tree_digest(run).items() if not k.startswith("sync_verified")} == before
    assert sha256_file(run / FINAL_DIR / "model.safetensors") == sha256_file(finished / FINAL_DIR / "model.safetensors")


def test_the_shipped_backup_manifest_runs_training_and_the_watcher_side_by_side(tmp_path):
    manifest = load_manifest(fail_closed.REPO / "ds_configs" / "jobs" / "tiny_backup.toml")
    train, backup = manifest.jobs
    assert (train.kind, backup.kind, train.after, backup.after) == ("training", "command", (), ())
    assert backup.inherit_environment == ("HF_TOKEN",) and "HF_TOKEN" not in backup.environment
    args = cli.build_parser().parse_args(list(backup.argv[1:]))  # the watcher's argv is a valid sync --watch
    assert args.watch == "runs/tiny-backup" and args.path_in_repo and args.pass_timeout > args.every
    assert f"--output-dir {args.watch}" in " ".join(train.argv) and "checkpoint.keep_unsynced=true" in train.argv
    assert "[program:backup]" in render_config(manifest, tmp_path)


def test_a_pass_leaves_alone_what_earlier_passes_verified_here_and_checks_other_prefixes(tmp_path, finished, server):
    run = copy_run(finished, tmp_path / "run")
    hub.sync(run, REPO, hub.make_api(), path_in_repo=PREFIX, log=lambda _: None)
    listings = server.counts.get("tree", 0)
    report = hub.sync(run, REPO, hub.make_api(), path_in_repo=PREFIX, incremental=True, log=lambda _: None)
    assert sorted(report.already_remote) == ["checkpoints/step_00000010", "checkpoints/step_00000020",
                                             "checkpoints/step_00000030", FINAL_DIR]
    assert server.counts.get("tree", 0) == listings and report.uploaded == []  # no request about them
    other = hub.sync(run, REPO, hub.make_api(), path_in_repo="elsewhere", incremental=True, log=lambda _: None)
    assert len(other.uploaded) == 4  # recorded for another prefix: not this one's
