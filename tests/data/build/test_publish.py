"""`data publish` through the real huggingface_hub client against the loopback stand-in Hub:
both corpus layouts, paths kept, every shard verified, a dropped commit resumed without re-sending,
a corrupted remote shard caught, local refusals that send nothing, and the token kept out of output."""
import hashlib
import json

import numpy as np

from ds_trhash.cli import main
from ds_trhash.data.formats.shards import write_shards
from tests.fail_closed import tree_digest
try:  # the stand-in Hub fixture (HF_ENDPOINT, HF_TOKEN, HF_HUB_DISABLE_XET set), wherever it lives
    from tests.release.conftest import TOKEN
    from tests.release.conftest import server as hub  # noqa: F401
except ImportError:
    from tests.release.hub.sync.test_sync import TOKEN
    from tests.release.hub.sync.test_sync import server as hub  # noqa: F401

TARGET = "hf://datasets/me/corpus"


def publish(capsys, root, target=TARGET):
    code = main(["data", "publish", str(root), target])
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    return code, captured.out, captured.err


def ours(root):
    """Our layout: two sources, plus a tokenize work directory and a part that must not be sent."""
    for k, source in enumerate(("web", "code")):
        docs = [np.append(np.arange(5 + k, 5 + k + n), 0) for n in (40, 31, 60)]
        write_shards(source, docs, 8, 3, root, vocab_size=1000, tokenizer_hash="h")
    (root / "web" / "tokenize_report.json").write_text('{"bad": 0}\n')
    (root / ".web.tokenize").mkdir()
    (root / ".web.tokenize" / "run.json").write_text("{}")
    (root / "web.part-0-of-2").mkdir()
    (root / "web.part-0-of-2" / "c-00000000.bin").write_bytes(b"x")
    return root


def released(root):
    """The release's layout: mixture_manifest.json and corpora/<source>/ with tokens-NNNNN.bin shards."""
    shards = []
    folder = root / "corpora" / "fineweb"
    folder.mkdir(parents=True)
    for k in range(2):
        data = np.arange(k * 16, k * 16 + 17, dtype="<u2").tobytes()
        (folder / f"tokens-{k:05d}.bin").write_bytes(data)
        shards.append({"file": f"tokens-{k:05d}.bin", "rows": 2, "tokens": 17, "bytes": 34,
                       "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"format": "tr-hash-token-mixture-v1", "source": "fineweb", "seq_len": 8, "dtype": "uint16",
                "rows": 4, "trained_tokens": 32, "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (root / "mixture_manifest.json").write_text(json.dumps({"format": "tr-hash-token-mixture-v1", "sources": [
        {"name": "fineweb", "rows": 4, "manifest": "corpora/fineweb/manifest.json"}]}))
    return root


def test_our_layout_is_published_with_its_paths_and_verified(hub, capsys, tmp_path):
    root = ours(tmp_path / "corpus")
    before = tree_digest(tmp_path)
    code, out, err = publish(capsys, root)
    assert code == 0, err
    repo = hub.repo("me/corpus", "dataset")
    expected = sorted(p for p, d in tree_digest(root).items() if d != "dir" and not p.startswith((".", "web.part")))
    assert sorted(repo.files) == expected
    assert all(repo.files[p].data == (root / p).read_bytes() for p in expected)
    assert all(repo.files[p].lfs for p in expected if p.endswith(".bin"))
    assert "2 manifests, 12 shards verified (size and SHA-256), 1 tokenize reports" in out
    assert f"commit {repo.head}" in out
    assert tree_digest(tmp_path) == before  # nothing local written (no upload cache in the corpus)
    assert not any(TOKEN.encode() in (tmp_path / p).read_bytes() for p, d in tree_digest(tmp_path).items() if d != "dir")


def test_the_release_layout_is_published_and_checked_against_its_manifests(hub, capsys, tmp_path):
    root = released(tmp_path / "release")
    code, out, err = publish(capsys, root)
    assert code == 0, err
    assert sorted(hub.repo("me/corpus", "dataset").files) == [
        "corpora/fineweb/manifest.json", "corpora/fineweb/tokens-00000.bin", "corpora/fineweb/tokens-00001.bin",
        "mixture_manifest.json"]
    assert "1 manifests, 2 shards verified" in out


def test_an_interrupted_publish_resumes_without_sending_what_arrived(hub, capsys, tmp_path):
    root = ours(tmp_path / "corpus")
    hub.drop["commit"] = {1}  # every shard reaches the Hub's LFS store, then the commit is cut off
    code, _, err = publish(capsys, root)
    assert code == 2 and "run the same command again to resume" in err and "Traceback" not in err
    assert ("dataset", "me/corpus") in hub.repos and not hub.repo("me/corpus", "dataset").files
    sent = hub.counts["lfs_upload"]
    assert sent == 12
    code, out, err = publish(capsys, root)
    assert code == 0, err
    assert hub.counts["lfs_upload"] == sent and hub.counts["commit"] == 2  # no shard sent twice
    assert "12 shards verified" in out
    before = dict(hub.counts)
    assert publish(capsys, root)[0] == 0  # published already: nothing sent, verified again
    assert hub.counts["lfs_upload"] == before["lfs_upload"] and hub.counts["commit"] == before["commit"]


def test_a_remote_shard_that_differs_from_its_manifest_fails_the_publish(hub, capsys, tmp_path):
    root = ours(tmp_path / "corpus")
    hub.corrupt.add("code/shard-00001.bin")
    before = tree_digest(tmp_path)
    code, _, err = publish(capsys, root)
    sha = json.loads((root / "code" / "manifest.json").read_text())["shards"][1]["sha256"]
    assert code == 2 and "code/shard-00001.bin: remote 50 bytes sha256" in err and f"expected 50 bytes sha256 {sha}" in err
    assert tree_digest(tmp_path) == before


def test_refusals_send_nothing_and_change_nothing(hub, capsys, tmp_path, monkeypatch):
    root = ours(tmp_path / "corpus")
    (root / "code" / "shard-00002.bin").write_bytes(b"\0\0")
    (tmp_path / "empty").mkdir()
    before = tree_digest(tmp_path)
    cases = [
        ((root, TARGET), "shard-00002.bin is 2 bytes locally, its manifest says"),
        ((root, "hf://models/me/corpus"), "is not hf://datasets/OWNER/REPO"),
        ((tmp_path / "empty", TARGET), "holds no manifest.json with shards"),
        ((tmp_path / "missing", TARGET), "does not exist"),
    ]
    for args, message in cases:
        code, _, err = publish(capsys, *args)
        assert code == 2 and message in err, (message, err)
    assert hub.requests == [] and tree_digest(tmp_path) == before
    root2 = released(tmp_path / "release")
    monkeypatch.setenv("HF_TOKEN", "hf_WRONGtokenVALUE0123456789")
    code, _, err = publish(capsys, root2)
    assert code == 2 and "401" in err and "<redacted>" in err and "WRONGtoken" not in err


def test_no_token_says_how_to_give_one_and_sends_nothing(hub, capsys, tmp_path, monkeypatch):
    """Without HF_TOKEN: the fix (export HF_TOKEN), not "run the same command again to resume"."""
    root = released(tmp_path / "release")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    before = tree_digest(tmp_path)
    code, _, err = publish(capsys, root)
    assert code == 2 and "HF_TOKEN is not set" in err and "export HF_TOKEN=hf_..." in err, err
    assert "run the same command again" not in err
    assert hub.requests == [] and tree_digest(tmp_path) == before
