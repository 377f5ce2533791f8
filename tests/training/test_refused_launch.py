"""A launch refused for its config says so once (not once per rank) and writes nothing."""
import hashlib

import pytest

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


def _tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def test_a_global_batch_that_does_not_split_is_refused_once_before_anything_is_written(tmp_path):
    (tmp_path / "keep.txt").write_text("already here")
    before = _tree(tmp_path)
    # 8 rows per step cannot be cut into micro-batches of 8 on each of 2 ranks
    proc = L.deepspeed(2, ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(tmp_path / "run"),
                           "--set", "batch.micro_batch=8", "--set", f"data.cache_dir={tmp_path / 'cache'}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, L.explain(proc)
    errors = [line for line in out.splitlines() if "error: " in line and "batch.global_tokens" in line]
    assert len(errors) == 1, L.explain(proc)
    assert "does not split over world size 2 with micro_batch 8" in errors[0]
    assert "nearest valid on 2 ranks: micro_batch 4 (grad_accum 1)" in errors[0]
    assert _tree(tmp_path) == before  # no run directory, no cache, no embedded corpus
