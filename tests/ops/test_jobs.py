"""A real supervisord started by `ds-trhash jobs up`: a SIGKILLed training rank is restarted by
supervisord with RESUME=auto and ends bit-identical to an uninterrupted run; `after` chains the
stages; secrets reach only the job that inherits them; `jobs stop` leaves no process behind."""
import json

import pytest

from tests.ops.conftest import EVERY, KILL_AFTER_STEP, PROBE_ARGS, SECRET, SECRET_VALUE, STEPS
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


def test_a_sigkilled_rank_is_restarted_and_the_run_ends_bit_identical(supervised):
    root, infos = supervised["root"], supervised["infos"]
    assert supervised["killed_at"] >= KILL_AFTER_STEP and supervised["killed_at"] < STEPS
    assert supervised["rank_env"]["RESUME"] == "auto"
    log = (supervised["manifest"].jobs_dir / "logs" / "pretrain.log").read_text()
    assert "resume auto: no checkpoint under" in log  # the first start ...
    # killed_at is read from metrics.csv just after the kill, so on a loaded machine it can run one
    # interval ahead of the newest complete checkpoint (or the rank saved once more before it died)
    last_saved = supervised["killed_at"] // EVERY * EVERY
    resumed = [line for line in log.splitlines() if "resuming at step" in line]
    assert any(f"resuming at step {s}" in line for line in resumed
               for s in (last_saved - EVERY, last_saved, last_saved + EVERY) if s > 0), \
        (supervised["killed_at"], resumed, log[-3000:])
    assert infos["pretrain"]["statename"] == "EXITED" and infos["pretrain"]["exitstatus"] == 0
    assert infos["reference"]["statename"] == "EXITED" and infos["reference"]["exitstatus"] == 0
    final = f"step_{STEPS:08d}"
    L.assert_identical(L.model_weights(root / "pre" / "checkpoints" / final),
                       L.model_weights(root / "reference" / "checkpoints" / final))


def test_after_chains_the_stages_and_secrets_reach_only_the_job_that_inherits_them(supervised):
    root, infos = supervised["root"], supervised["infos"]
    for name in ("refine", "sft", "refine_again", "probe"):
        assert infos[name]["statename"] == "EXITED" and infos[name]["exitstatus"] == 0, infos[name]
    assert infos["refine"]["start"] >= infos["reference"]["stop"]
    assert infos["sft"]["start"] >= infos["refine"]["stop"]
    assert infos["probe"]["start"] >= max(infos["sft"]["stop"], infos["pretrain"]["stop"], infos["refine_again"]["stop"])
    probe = json.loads((root / "probe.json").read_text())
    assert probe == {"argv": PROBE_ARGS, "secret": SECRET_VALUE, "resume": None}  # a command job: no RESUME
    assert SECRET not in supervised["rank_env"]  # the training job did not name it
    jobs_dir = supervised["manifest"].jobs_dir
    for path in [p for p in jobs_dir.rglob("*") if p.is_file()] + [root / "pipeline.toml"]:
        assert SECRET_VALUE.encode() not in path.read_bytes(), path
    status = supervised["status"]
    assert status.returncode == 0, status.stderr
    assert [line.split()[:2] for line in status.stdout.splitlines()] == [
        ["pretrain", "EXITED"], ["reference", "EXITED"], ["refine", "EXITED"], ["sft", "EXITED"],
        ["refine_again", "EXITED"], ["probe", "EXITED"], ["idle", "RUNNING"]]


def test_a_finished_stage_brought_up_again_exits_0_without_training_and_its_followers_run(supervised):
    """What `jobs up` after a reboot does to a finished stage: RESUME=auto, nothing trained, exit 0."""
    infos = supervised["infos"]
    log = (supervised["manifest"].jobs_dir / "logs" / "refine_again.log").read_text()
    assert "refinement already finished at step 2 of 2; nothing is left to train" in log, log[-3000:]
    assert "[refinement] step " not in log  # no training step ran
    assert infos["refine_again"]["start"] >= infos["refine"]["stop"] and infos["refine_again"]["exitstatus"] == 0


def test_a_second_jobs_up_is_refused_while_the_first_runs(supervised):
    proc = supervised["second_up"]
    assert proc.returncode == 2 and "its supervisord is already running" in proc.stderr, proc.stderr


def test_jobs_stop_leaves_no_process_behind(supervised):
    stop = supervised["stop"]
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "no job process is left" in stop.stdout
    assert supervised["alive_after_stop"] == []
    assert not (supervised["manifest"].jobs_dir / "supervisord.pid").exists()
    again = L.subprocess.run([L.sys.executable, "-m", "ds_trhash.cli", "jobs", "status",
                              str(supervised["root"] / "pipeline.toml")], cwd=L.REPO, capture_output=True, text=True)
    assert again.returncode == 3 and "is not running" in again.stdout
