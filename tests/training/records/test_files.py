"""The record file names (training/records/files.py): one definition the writers and the
report's readers share, importable without torch."""
import subprocess
import sys


def test_writers_and_readers_name_the_same_files():
    from ds_trhash.report import series
    from ds_trhash.training.records import expert_load, files, metrics_csv

    assert (files.METRICS_FILE, files.EXPERT_LOAD_FILE) == ("metrics.csv", "expert_load.csv")
    assert metrics_csv.METRICS_FILE is files.METRICS_FILE and expert_load.EXPERT_LOAD_FILE is files.EXPERT_LOAD_FILE
    assert series.METRICS_FILE is files.METRICS_FILE and series.EXPERT_LOAD_FILE is files.EXPERT_LOAD_FILE


def test_the_names_import_without_torch():
    code = "import sys; import ds_trhash.training.records.files; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
