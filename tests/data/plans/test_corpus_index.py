"""The corpus index the plan builders read (manifests only): both layouts, and the release
layout's refusals, each naming the file and what is wrong."""
import json

import pytest

from ds_trhash.data.plans.corpus_index import CorpusIndexError, ShardRows, index_of_manifests, read_corpus_index
from ds_trhash.data.formats.manifest import ManifestError
from tests.data.release_corpus import write_release_layout
from tests.data.plans.test_plan import MANIFESTS


def test_our_manifests_keep_their_tokenizer_identity():
    index = index_of_manifests(MANIFESTS)
    assert index.seq_len == 16 and index.identity == {"vocab_size": 1000, "tokenizer_sha256": "tok"}
    assert index.sources["code"] == tuple(ShardRows(f"shard-{i:05d}.bin", 8) for i in range(3))
    assert index.rows("web") == 35


def _edit(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("target, change, needle", [  # the manifests' one validation layer (data/manifest.py)
    ("mixture_manifest.json", lambda d: d.update(format="other"), "field 'format' is 'other'; allowed: "
                                                                  "'tr-hash-token-mixture-v1'"),
    ("corpora/b/manifest.json", lambda d: d.update(seq_len=16), "field 'seq_len' is 16, but the mixture manifest says 8"),
    ("corpora/a/manifest.json", lambda d: d["shards"].append(dict(d["shards"][0])),
     "field 'shards[2].file' is 'tokens-00000.bin' again"),
    ("corpora/a/manifest.json", lambda d: d["shards"][0].update(file="sub/tokens-00000.bin"),
     "it must be a bare name without a directory part"),
    ("corpora/a/manifest.json", lambda d: d.update(rows=99), "field 'rows' is 99, but its shards hold 20 rows"),
    ("mixture_manifest.json", lambda d: d["sources"][1].update(rows=7), "field 'rows' of source 'b' is 7"),
    ("corpora/b/manifest.json", lambda d: d.update(shards=[]), "field 'shards' is empty"),
    ("mixture_manifest.json", lambda d: d["sources"].append(dict(d["sources"][0])), "'sources[2].name' is 'a' again"),
])
def test_release_layout_refusals_name_the_file(tmp_path, target, change, needle):
    root = write_release_layout(tmp_path / "c", {"a": [10, 10], "b": [8]}, seq_len=8)
    _edit(root / target, change)
    with pytest.raises((CorpusIndexError, ManifestError)) as info:
        read_corpus_index([root])
    assert needle in str(info.value) and target.split("/")[-1] in str(info.value)


def test_a_missing_source_manifest_and_a_mixed_request_are_refused(tmp_path):
    root = write_release_layout(tmp_path / "c", {"a": [10], "b": [8]}, seq_len=8)
    with pytest.raises(CorpusIndexError, match="seq_len 8, requested 16"):
        read_corpus_index([root], seq_len=16)
    with pytest.raises(CorpusIndexError, match="pass it alone"):
        read_corpus_index([root, tmp_path])
    (root / "corpora" / "b" / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="corpora/b/manifest.json is missing, but .*mixture_manifest.json lists source 'b'"):
        read_corpus_index([root])
