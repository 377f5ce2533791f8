"""The corpus commands as users run them: a `ds-trhash data tokenize` killed with SIGKILL and started
again, a Hugging Face dataset streamed through `datasets`, argument combinations."""
import contextlib
import json
import os
import signal
import subprocess
import time

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ds_trhash.cli import main
from ds_trhash.data.build.chunk_store import ChunkStore
from tests.data.tokenize_fixtures import ROWS, SEQ_LEN, corpus_tok, text, tokenize  # noqa: F401 (fixture)
from tests.fail_closed import REPO, VENV_BIN, tree_digest


def test_a_killed_run_started_again_keeps_its_chunks_and_ends_byte_identical(tmp_path, capsys, corpus_tok, monkeypatch):
    data = tmp_path / "in" / "big.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"text": text(i)}) + "\n" for i in range(1200)))
    out = tmp_path / "shards"
    argv = [str(VENV_BIN / "ds-trhash"), "data", "tokenize", "--input", str(data), "--source", "web",
            "--tokenizer", str(corpus_tok), "--seq-len", str(SEQ_LEN), "--rows-per-shard", str(ROWS),
            "--vocab-size", "400", "--out", str(out), "--chunk-records", "8", "--workers", "2"]
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    work = out / ".web.tokenize"
    deadline = time.monotonic() + 120
    while len(list(work.glob("c-*.json"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGSTOP)  # freeze it (workers too) to look, then kill -9 the command
    try:
        completed = sorted(work.glob("c-*.json"))
        mid_run = not (work / "done.json").exists() and not (out / "web").exists()
        workers = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait(timeout=30)
        os.killpg(proc.pid, signal.SIGCONT)  # the workers run on, find their parent gone, and exit
        assert len(workers) == 2 and _gone(workers, 15), "a worker outlived its killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert mid_run and 3 <= len(completed) < 150, len(completed)
    kept = len([p for p in work.glob("c-*.json") if p.with_suffix(".bin").exists()])

    before = tree_digest(tmp_path)  # a different command over the partial run is refused, nothing changes
    code, _, err = tokenize(capsys, [data], out, corpus_tok, "--rows-per-shard", "8", "--chunk-records", "8")
    assert code == 2 and "rows_per_shard: 4 (partial run) vs 8 (this command)" in err
    assert tree_digest(tmp_path) == before

    written = []  # the same command continues: the completed chunks are verified and not redone
    original = ChunkStore.write
    monkeypatch.setattr(ChunkStore, "write", lambda self, index, *a: written.append(index) or original(self, index, *a))
    code, stdout, err = tokenize(capsys, [data], out, corpus_tok, "--chunk-records", "8", "--workers", "2")
    assert code == 0, err
    assert f"continuing after {kept} completed chunks" in stdout and written == list(range(kept, 150))
    assert tokenize(capsys, [data], tmp_path / "reference", corpus_tok, "--chunk-records", "64", "--workers", "1")[0] == 0
    assert tree_digest(out) == tree_digest(tmp_path / "reference")


def _gone(processes, timeout_s):
    """Every process has exited (a zombie waiting for its new parent counts) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_a_hugging_face_dataset_streams_to_the_same_shards_as_its_files(tmp_path, capsys, corpus_tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    repo = tmp_path / "dataset"
    (repo / "data").mkdir(parents=True)
    docs = [text(i) for i in range(120)]
    pq.write_table(pa.table({"content": docs[:70]}), repo / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"content": docs[70:]}), repo / "data" / "train-00001-of-00002.parquet")
    code = main(["data", "tokenize", "--hf-dataset", str(repo), "--split", "train", "--text-field", "content",
                 "--source", "web", "--tokenizer", str(corpus_tok), "--seq-len", str(SEQ_LEN), "--rows-per-shard",
                 str(ROWS), "--vocab-size", "400", "--out", str(tmp_path / "hf"), "--chunk-records", "16"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"hf:{repo}:train: 120 records, 120 documents" in out.out
    files = sorted((repo / "data").glob("*.parquet"))
    assert tokenize(capsys, files, tmp_path / "files", corpus_tok, "--text-field", "content")[0] == 0
    hf, local = tree_digest(tmp_path / "hf"), tree_digest(tmp_path / "files")
    del hf["web/tokenize_report.json"], local["web/tokenize_report.json"]  # they name their inputs
    assert hf == local


@pytest.mark.parametrize("argv, message", [
    (["--input", "a.txt", "--hf-dataset", "x"], "not allowed with argument"),
    ([], "one of the arguments --input --hf-dataset is required"),
])
def test_inputs_are_files_or_one_dataset(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["data", "tokenize", *argv, "--source", "s", "--tokenizer", "t", "--seq-len", "8",
              "--rows-per-shard", "2", "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
