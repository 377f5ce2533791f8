"""An out-of-memory step on one rank of two, through the deepspeed launcher: retried in place by
both ranks at the smaller micro-batch (ZeRO 1), or every rank stopped with exit 77 and resumed
at it (ZeRO 2); the same rows and the same losses (1e-5) as the run without the fault. The
ZeRO-1 run is also SIGKILLed after the switch, and its resume trains the steps the killed launch
had trained past its last checkpoint to the same bits, at the micro-batch in force."""
import json
import re

import pytest

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = L.REFERENCE_STEPS
TOLERANCE = 1e-5


def _rows(out):
    return [int(r["tokens_seen"]) for r in L.metrics(out) if r["train_loss"]]


def _assert_same_run(out, ref):
    assert _rows(out) == _rows(ref)  # the same rows every step: the data cursor never moved back or on
    got, want = L.train_losses(out), L.train_losses(ref)
    assert len(got) == len(want) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOLERANCE, list(zip(got, want))


KILLED_AFTER = 9  # the kill comes before step 9's checkpoint and row: the resume starts at step 6


@pytest.fixture(scope="module")
def retried(tmp_path_factory):
    """The ZeRO-1 reference run with rank 1 out of memory in step 3 (micro-batch 4 of 4 rows),
    killed after step 9 and resumed to the end: (output dir, the faulted launch, the losses it
    logged, the resume)."""
    out = tmp_path_factory.mktemp("oom") / "retried"
    proc = L.deepspeed(2, L.reference_run(out, micro=4),
                       DS_TRHASH_FAULT=f"oom_at_step:3:1,kill_after_step:{KILLED_AFTER}")
    assert L.was_killed(proc), L.explain(proc)
    killed = L.whole_losses(out)
    resumed = L.deepspeed(2, L.reference_run(out, micro=4) + ["--resume", "auto"])
    assert resumed.returncode == 0, L.explain(resumed)
    return out, proc, killed, resumed


def test_both_ranks_retry_the_step_in_place_at_the_smaller_micro_batch(retried, shared_launches):
    out, proc, _, _ = retried
    ref = shared_launches.get(2, lambda o: L.reference_run(o, micro=4))
    _assert_same_run(out, ref)
    said = proc.stdout + proc.stderr
    assert said.count("step 3: out of device memory at micro-batch 4 on rank 1; every rank abandoned the step and "
                      "trains it again on the same rows at micro-batch 2, grad_accum 2") == 1, L.explain(proc)
    record = json.loads((out / "micro_batch.json").read_text())
    assert record["micro_batch"] == 2 and [(e["step"], e["rank"], e["from"], e["to"], e["how"])
                                           for e in record["events"]] == [(3, 1, 4, 2, "in place")]
    states = {s: json.loads((out / "checkpoints" / f"step_{s:08d}" / "trainer_state.json").read_text())
              for s in (3, 6, STEPS)}
    assert {state["micro_batch_in_force"] for state in states.values()} == {2}
    assert states[6]["training_critical"]["batch.micro_batch"] == 4  # the data's cut: the plan's, unchanged


def test_a_sigkill_after_the_switch_resumes_bit_identically(retried):
    """The resume restores micro-batch 2 (not the config's 4) with the weights, moments and data
    cursor: steps 7 and 8, trained again, have the killed launch's losses to the bit."""
    out, _, killed, resumed = retried
    assert len(killed) == KILLED_AFTER - 1 and L.checkpoint_steps(out)[:2] == [3, 6]
    said = resumed.stdout + resumed.stderr
    assert "resuming at step 6" in said and "micro-batch 2 in force (grad_accum 2, the same global batch)" in said
    assert L.train_losses(out)[:KILLED_AFTER - 1] == killed


def test_zero_2_stops_every_rank_with_77_and_resumes_at_the_smaller_size(shared_launches, tmp_path):
    ref = shared_launches.get(2, lambda o: L.reference_run(o, micro=4, zero=2))
    out = tmp_path / "exited"
    args = L.reference_run(out, micro=4, zero=2)
    proc = L.deepspeed(2, args, DS_TRHASH_FAULT="oom_at_step:5:1")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 77, L.explain(proc)
    # the failing rank aborts through liveness: its own line, and its peer names it (no "lost contact")
    assert "error: rank 1/2: aborting every rank: out of device memory at step 5 (micro-batch 4); ZeRO 2 reduces " \
           "gradients inside every backward" in said, L.explain(proc)
    assert re.search(r"error: rank 0/2: rank 1 \(node 0, host [^)]+\) aborted the run: out of device memory at step 5",
                     said), L.explain(proc)
    assert "lost contact" not in said and "Traceback" not in said, L.explain(proc)
    assert L.checkpoint_steps(out) == [3]
    record = json.loads((out / "micro_batch.json").read_text())
    assert record["micro_batch"] == 2 and record["events"][-1]["how"] == "exit"
    proc = L.deepspeed(2, args + ["--resume", "auto"])
    assert proc.returncode == 0, L.explain(proc)
    _assert_same_run(out, ref)
