"""`--part i/K` and `data merge-parts`: K parts joined equal one single-machine run, byte for byte."""
import os
import shutil

import pytest

from ds_trhash.cli import main
from ds_trhash.data.build.parts import parse_part
from ds_trhash.data.formats.shards import ShardError
from tests.data.tokenize_fixtures import corpus_tok, tokenize, write_inputs  # noqa: F401 (corpus_tok is a fixture)
from tests.fail_closed import tree_digest


def merge(capsys, *argv):
    code = main(["data", "merge-parts", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture()
def parts(tmp_path, capsys, corpus_tok):
    """A single-machine run (``single/web``) and the three parts of the same run (in ``p/``), the
    last one over inputs whose modification times changed (as copies on another machine)."""
    inputs = write_inputs(tmp_path / "in", 200)
    assert tokenize(capsys, inputs, tmp_path / "single", corpus_tok)[0] == 0
    for index, workers in ((0, 1), (1, 2), (2, 1)):
        if index == 2:  # the last part reads a copy of the inputs: same names and sizes, other mtimes
            for path in inputs:
                os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**10))
        code, out, err = tokenize(capsys, inputs, tmp_path / "p", corpus_tok, "--part", f"{index}/3", "--workers", workers)
        assert code == 0, err
        assert f"part {index}/3 complete, 200 records read" in out
    return tmp_path, inputs, [tmp_path / "p" / f"web.part-{i}-of-3" for i in range(3)]


def test_merged_parts_equal_a_single_run(parts, capsys):
    tmp, _, dirs = parts
    assert sorted(p.name for p in (tmp / "p").iterdir()) == [d.name for d in dirs]  # no lock files left
    owned = [sorted(int(p.stem[2:]) for p in d.glob("c-*.json")) for d in dirs]
    assert owned == [[0, 3, 6, 9, 12], [1, 4, 7, 10], [2, 5, 8, 11]]  # 200 records in chunks of 16
    before = tree_digest(tmp / "p")
    code, out, err = merge(capsys, dirs[2], dirs[0], dirs[1], "--out", tmp / "merged")
    assert code == 0, err
    assert "200 documents" in out
    assert tree_digest(tmp / "merged") == tree_digest(tmp / "single")  # shards, manifest and report
    assert tree_digest(tmp / "p") == before  # the parts are left as they were


def test_merge_refuses_what_is_not_one_whole_run(parts, capsys, corpus_tok):
    tmp, inputs, dirs = parts
    other = tmp / "other"
    assert tokenize(capsys, inputs, other, corpus_tok, "--part", "1/3", "--seq-len", "8")[0] == 0
    partial = tmp / "partial" / "web.part-2-of-3"
    shutil.copytree(dirs[2], partial)
    (partial / "done.json").unlink()
    damaged = tmp / "damaged" / "web.part-1-of-3"
    shutil.copytree(dirs[1], damaged)
    data = damaged / "c-00000004.bin"
    data.write_bytes(b"\0" + data.read_bytes()[1:])
    (tmp / "merged" / "web").mkdir(parents=True)
    cases = [
        ((dirs[0], dirs[1]), "parts 2/3 are missing"),
        ((dirs[0], dirs[1], dirs[1]), "part 1/3 is given twice"),
        ((dirs[0], other / "web.part-1-of-3", dirs[2]), "seq_len: 16"),
        ((dirs[0], dirs[1], partial), "is not complete; run its `data tokenize --part` command again"),
        ((dirs[0], damaged, dirs[2]), "c-00000004.bin does not match its record (damaged)"),
        ((dirs[0], dirs[1], tmp / "in"), "is not a tokenize work directory"),
    ]
    before = tree_digest(tmp)
    for given, message in cases:
        code, _, err = merge(capsys, *given, "--out", tmp / "out")
        assert code == 2 and message in err, (message, err)
        assert tree_digest(tmp) == before, message
    code, _, err = merge(capsys, *dirs, "--out", tmp / "merged")
    assert code == 2 and "web already exists" in err and tree_digest(tmp) == before


def test_part_syntax():
    assert parse_part("0/1") == (0, 1) and parse_part("3/4") == (3, 4)
    for bad in ("1/1", "4", "a/b", "-1/2", "1/0"):
        with pytest.raises(ShardError, match="must be I/K"):
            parse_part(bad)
