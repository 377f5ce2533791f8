"""`ds-trhash cleanup RUN_DIR`: numbered checkpoints go only after a completed stage, a verified
final/ and (when the run syncs) their verification on the Hub; every refusal names the condition
and changes nothing."""
import os
import shutil
import signal
import time

import pytest

from ds_trhash import cli
from ds_trhash.checkpoints import list_checkpoints, run_lock
from ds_trhash.checkpoints.sync_guard import LOCK_FILE
from ds_trhash.release.export.writer import WEIGHTS
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.lifecycle.final import COMPLETE_FILE, FINAL_DIR
from tests.release.run_fixtures import copy_run, make_run, tree_digest

PACKS = {10: 1, 30: 2}  # steps 10 and 30 end token packs; step 20 is a cadence checkpoint


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("cleanup") / "run", packs=PACKS)
    shutil.copytree(run / "checkpoints" / "step_00000030", run / "best")  # what an SFT selection leaves
    return run


@pytest.fixture(scope="module")
def synced_template(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("cleanup-synced") / "run", packs=PACKS, keep_unsynced=True)


def _cleanup(capsys, *args):
    code = cli.main(["cleanup", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refused(capsys, run, *args, needle):
    before = tree_digest(run)
    code, _, err = _cleanup(capsys, run, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert tree_digest(run) == before
    return err


def test_keep_packs_leaves_final_best_and_the_pack_checkpoints(tmp_path, template, capsys):
    run = copy_run(template, tmp_path / "run")
    code, out, _ = _cleanup(capsys, run)
    assert code == 0 and "removed 1, kept 2" in out
    assert [c.step for c in list_checkpoints(run)] == [10, 30]
    assert sorted(p.name for p in run.iterdir() if p.name != LOCK_FILE) == [
        "best", "checkpoints", "config.json", FINAL_DIR, COMPLETE_FILE]


def test_keep_final_leaves_exactly_final_best_and_the_run_records(tmp_path, template, capsys):
    run = copy_run(template, tmp_path / "run")
    untouched = {k: v for k, v in tree_digest(run).items() if not k.startswith("checkpoints")}
    code, _, _ = _cleanup(capsys, run, "--keep", "final")
    assert code == 0 and list_checkpoints(run) == [] and not list((run / "checkpoints").iterdir())
    assert {k: v for k, v in tree_digest(run).items() if k != "checkpoints"} == untouched


def test_refusals_name_the_condition_and_delete_nothing(tmp_path, template, capsys):
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "todo.txt").write_text("not a run")
    _refused(capsys, stray, needle="is not a run output directory")
    assert sorted(p.name for p in stray.iterdir()) == ["todo.txt"]  # not even a lock file

    unfinished = copy_run(template, tmp_path / "unfinished")
    (unfinished / COMPLETE_FILE).unlink()
    _refused(capsys, unfinished, needle="the stage has not completed")

    no_final = copy_run(template, tmp_path / "no-final")
    shutil.rmtree(no_final / FINAL_DIR)
    _refused(capsys, no_final, needle="final/ does not verify")

    corrupt = copy_run(template, tmp_path / "corrupt")
    weights = corrupt / FINAL_DIR / WEIGHTS
    weights.write_bytes(b"!" + weights.read_bytes()[1:])
    _refused(capsys, corrupt, "--keep", "final", needle="SHA-256 differs")


def test_a_running_launch_is_refused_by_its_pid(tmp_path, template, capsys):
    run = copy_run(template, tmp_path / "run")
    ready_r, ready_w = os.pipe()
    pid = os.fork()  # another process holding the run lock, as a launch's rank 0 does
    if pid == 0:
        try:
            run_lock.acquire(run)
            os.write(ready_w, b"1")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        err = _refused(capsys, run, needle="a launch is still running there")
        assert f"pid {pid} " in err
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert _cleanup(capsys, run)[0] == 0  # the kernel released the lock with the process


def test_a_syncing_run_keeps_what_the_hub_has_not_verified(tmp_path, synced_template, server, capsys):
    run = copy_run(synced_template, tmp_path / "run")
    err = _refused(capsys, run, "--keep", "final", needle="not verified on the Hub")
    assert "step_00000010, step_00000020, step_00000030" in err
    hub.sync(run, "me/run", hub.make_api(), log=lambda _: None)  # the one-shot sync verifies every unit
    code, _, _ = _cleanup(capsys, run, "--keep", "final")
    assert code == 0 and list_checkpoints(run) == []
    assert (run / FINAL_DIR / WEIGHTS).is_file()


def test_a_dry_run_says_what_it_would_remove_and_removes_nothing(tmp_path, template, capsys):
    run = copy_run(template, tmp_path / "run")
    before = tree_digest(run)
    code, out, _ = _cleanup(capsys, run, "--dry-run")
    assert code == 0 and "would remove checkpoints/step_00000020" in out, out
    assert "dry run): would remove 1, would keep 2 numbered checkpoint(s); nothing was removed" in out, out
    assert "removed 1" not in out and tree_digest(run) == before


def test_the_advice_for_a_missing_final_is_a_command_that_works(tmp_path, template, capsys):
    """The refusal names an export command; run as printed, it writes a final/ cleanup accepts."""
    import re
    import shlex

    run = copy_run(template, tmp_path / "run")
    shutil.rmtree(run / FINAL_DIR)
    err = _refused(capsys, run, needle="final/ does not verify")
    command = re.search(r"`ds-trhash (export [^`]+)`", err)
    assert command, err
    assert cli.main(shlex.split(command.group(1))) == 0, capsys.readouterr().err
    code, out, _ = _cleanup(capsys, run)
    assert code == 0 and "removed 1, kept 2" in out, out
