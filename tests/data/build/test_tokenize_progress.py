"""`data tokenize` progress (data/build/tokenize_progress.py): rows, tokens, rate and time left on stderr,
a rich live line on a terminal and plain lines anywhere else; stdout keeps only the result."""
import io
import os
import pty
import subprocess

import pytest

from ds_trhash.data.build.inputs import file_inputs, iter_records
from ds_trhash.data.build.tokenize_progress import TokenizeProgress
from tests.data.tokenize_fixtures import corpus_tok, write_inputs  # noqa: F401
from tests.fail_closed import REPO, VENV_BIN

ARGS = ["--source", "web", "--seq-len", "16", "--rows-per-shard", "8", "--vocab-size", "400", "--chunk-records", "32",
        "--workers", "1"]


def _command(files, tok, out):
    return [str(VENV_BIN / "ds-trhash"), "data", "tokenize", "--input", *map(str, files), "--tokenizer", str(tok),
            *ARGS, "--out", str(out)]


def test_off_a_terminal_the_progress_is_a_plain_line_on_stderr(tmp_path, corpus_tok):
    files = write_inputs(tmp_path / "in", 240)
    plain = [files[0], files[1], files[3]]  # text, JSONL, Parquet: every end is known
    proc = subprocess.run(_command(plain, corpus_tok, tmp_path / "out"), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("tokenize web: ")]
    assert len(line) == 1 and "180 rows" in line[0] and "tokens/s" in line[0] and "100%, time left 0:00:00" in line[0]
    assert "\x1b[" not in proc.stderr and "tokenize web:" not in proc.stdout and "manifest.json" in proc.stdout


def test_on_a_terminal_rich_draws_the_live_line(tmp_path, corpus_tok):
    files = write_inputs(tmp_path / "in", 240)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(_command(files, corpus_tok, tmp_path / "out"), cwd=REPO, stdin=follower,
                            stdout=subprocess.PIPE, stderr=follower, env=dict(os.environ, COLUMNS="200"))
    os.close(follower)
    seen = b""
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        seen += data
    proc.wait(timeout=120)
    os.close(leader)
    text = seen.decode("utf-8", "replace")
    assert proc.returncode == 0 and "tokenize web: 240 rows" in text and "tokens/s" in text, text[-2000:]
    assert "\x1b[" in text  # drawn in place (cursor codes), not a plain log line
    assert "time left" not in text.split("tokenize web: 240 rows")[-1]  # a .gz input: no known end


def test_plain_lines_come_every_interval_with_the_time_left(tmp_path):
    files = write_inputs(tmp_path / "in", 200)
    specs = file_inputs([files[0], files[3]])  # 50 text blocks, then 50 Parquet rows
    now = [0.0]
    out = io.StringIO()
    progress = TokenizeProgress("web", specs, stream=out, every=10.0, clock=lambda: now[0], live=False)
    seen = 0
    for item in progress.observe(iter_records(specs, "text")):
        seen += 1
        if seen == 50:  # every text block read and stored, no Parquet row yet
            now[0] = 20.0
            progress.chunk({"records": 50, "tokens": 500})
            halfway = progress.fraction()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenize web: 50 rows, 500 tokens, 25 tokens/s, 0:00:20 elapsed")
    share = specs[0].path.stat().st_size / (specs[0].path.stat().st_size + specs[1].path.stat().st_size)
    assert halfway == pytest.approx(share, rel=0.1)  # the text file read and stored, by its bytes
    assert "time left 0:00:" in lines[0]
    now[0] = 25.0
    progress.chunk({"records": 50, "tokens": 500})  # under the interval: no line
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "100 rows" in lines[1] and "100%, time left 0:00:00" in lines[1]
