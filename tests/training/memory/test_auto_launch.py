"""batch.micro_batch auto through the deepspeed launcher on two ranks whose memory-cap doubles
differ: both take the smallest size either found, the run records it, and a resume keeps it
(auto or the recorded number) and refuses any other."""
import json

import pytest

from ds_trhash.training import config as tcfg
from ds_trhash.training.preparation.footprint import GIB, estimate
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

BATCH = ["--set", "batch.micro_batch=auto", "--set", "batch.global_tokens=2048"]  # 8 rows of a rank's step


def _estimate(m: int) -> int:
    cfg = tcfg.for_world(tcfg.load_config("ds_configs/tiny/pretrain.yaml",
                                          overrides=[f"batch.micro_batch={m}", "batch.global_tokens=2048"]), 2)
    return estimate(cfg, tcfg.model_config(cfg), 2, "cpu").per_rank


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto") / "run"
    # rank 0's device holds micro-batch 4 (not 8), rank 1's only 2 (not 4), with the 10 % headroom
    caps = [(_estimate(a) + _estimate(b)) / 2 / 0.9 / GIB for a, b in ((4, 8), (2, 4))]
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "2", *BATCH]
    proc = L.deepspeed(2, args, DS_TRHASH_MEMORY_CAP=",".join(f"{c:.6f}" for c in caps))
    assert proc.returncode == 0, L.explain(proc)
    return out, args, proc


def test_every_rank_takes_the_smallest_size_any_rank_found_and_the_run_records_it(launched):
    out, _, proc = launched
    said = proc.stdout + proc.stderr
    assert "batch.micro_batch auto: 2 (grad_accum 4) among 8, 4, 2, 1 (the sizes that divide the 8 rows of a " \
           "rank's step)" in said, L.explain(proc)
    assert "this rank found 4; every rank takes the smallest any rank found" in said
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["training_critical"]["batch.micro_batch"] == 2 and state["training_critical"]["batch.grad_accum"] == 4
    assert json.loads((out / "config.json").read_text())["batch"]["micro_batch"] == "auto"  # as configured


def test_a_resume_keeps_the_recorded_size_and_refuses_another(launched):
    out, args, _ = launched
    proc = L.deepspeed(2, [*args, "--resume", "auto"])
    assert proc.returncode == 0, L.explain(proc)
    assert "batch.micro_batch auto: 2, the size the run recorded (a resume keeps it)" in proc.stdout + proc.stderr
    before = sorted(p.name for p in out.rglob("*"))
    proc = L.deepspeed(2, [*args, "--resume", "auto", "--set", "batch.micro_batch=4"])
    assert proc.returncode == 2, L.explain(proc)
    assert "batch.micro_batch: checkpoint 2, this run 4" in proc.stdout + proc.stderr
    assert sorted(p.name for p in out.rglob("*")) == before
