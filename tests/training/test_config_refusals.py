"""Configs that must be refused at the config check, each with the real key and the reason, exit 2,
no traceback and nothing written (the output directory is never created)."""

import subprocess
import sys

import pytest

from ds_trhash.training.entrypoint import main
from tests.fail_closed import REPO, tree_digest

TINY = (REPO / "ds_configs" / "tiny" / "pretrain.yaml").read_text(encoding="utf-8")


def _refused(capsys, tmp_path, config, *argv):
    before = tree_digest(tmp_path)
    rc = main(["--config", str(config), "--output-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert tree_digest(tmp_path) == before
    return err


def _config(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def test_fp16_on_a_cpu_only_machine_is_refused_with_the_reason(capsys, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device can run fp16")
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", "precision=fp16")
    assert "precision: fp16 needs a CUDA device" in err and "use fp32" in err


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1"])
def test_a_seed_outside_64_bits_names_seed(capsys, tmp_path, seed):
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", f"seed={seed}")
    assert f"seed: must fit an unsigned 64-bit integer (0 <= seed < 2**64), got {seed}" in err


def test_a_config_that_is_not_utf8_is_refused(capsys, tmp_path):
    path = _config(tmp_path, TINY.replace("# Tiny demo", "# Tiny d\u00e9mo").encode("latin-1"))
    err = _refused(capsys, tmp_path, path)
    assert f"{path}: not UTF-8 text (byte 0xe9 at offset" in err


def test_a_duplicate_key_names_the_key_and_both_lines(capsys, tmp_path):
    lines = TINY.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("seed:")) + 1
    path = _config(tmp_path, TINY + "seed: 7\n")
    err = _refused(capsys, tmp_path, path)
    assert f"duplicate key 'seed' on line {first} and line {len(lines) + 1}" in err
    nested = _config(tmp_path, TINY.replace("  seq_len: 128\n", "  seq_len: 128\n  seq_len: 64\n"), "n.yaml")
    assert "duplicate key 'seq_len'" in _refused(capsys, tmp_path, nested)


@pytest.mark.e2e  # launch/train.py itself, refused before torch.distributed starts
def test_the_real_entry_point_prints_one_line_and_no_traceback(tmp_path):
    config = _config(tmp_path, TINY + "seed: 7\n")
    before = tree_digest(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(config),
                           "--output-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert "duplicate key 'seed'" in proc.stderr and tree_digest(tmp_path) == before


def test_a_cache_size_that_rounds_to_zero_bytes_names_data_cache_gb(capsys, tmp_path):
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", "data.cache_gb=1.0e-12")
    assert "data.cache_gb: 1e-12 GiB rounds to 0 bytes" in err


def test_skip_step_needs_zero_stage_0_and_fp32(capsys, tmp_path):
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", "training.nonfinite=skip_step",
                   "--set", "zero.stage=1")
    assert "training.nonfinite: skip_step zeroes a step's gradients" in err
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", "training.nonfinite=sometimes")
    assert "training.nonfinite" in err and "skip_step" in err


def test_a_silence_limit_of_fewer_than_five_heartbeats_names_both_liveness_keys(capsys, tmp_path):
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", "liveness.silent_s=3")
    assert "liveness.silent_s: 3 s is less than 5 heartbeats of liveness.interval_s (1 s)" in err
    err = _refused(capsys, tmp_path, _config(tmp_path, TINY), "--set", "liveness.stuck_minutes=0")
    assert "liveness.stuck_minutes: must be > 0, got 0" in err
