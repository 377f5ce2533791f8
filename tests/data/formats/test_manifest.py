"""The corpus-manifest validation layer: both formats parse to one normalized form, and every
rule of the release's loader and every malformed value is one message naming file and field."""

import copy
import hashlib

import pytest

from ds_trhash.data.formats.manifest import (
    LEGACY_FORMAT, MIXTURE_FORMAT, ManifestError, Shard, SourceManifest, check_against_mixture,
    parse_mixture_manifest, parse_source_manifest,
)

L = 8
ORIGIN = "hf://datasets/o/r@abc/corpora/dclm/manifest.json"


def _shard(i, rows=3):
    tokens = rows * L + 1
    return {"file": f"tokens-{i:05d}.bin", "rows": rows, "tokens": tokens, "bytes": 2 * tokens,
            "sha256": hashlib.sha256(str(i).encode()).hexdigest()}


def release_source(rows=(3, 2)):
    shards = [_shard(i, r) for i, r in enumerate(rows)]
    return {"format": MIXTURE_FORMAT, "source": "dclm", "weight": 0.3, "seq_len": L, "dtype": "uint16",
            "rows": sum(rows), "trained_tokens": sum(rows) * L, "source_tokens_consumed": 99, "shards": shards}


def legacy_source():
    """A manifest in the format our writer wrote before (corpora made then keep loading)."""
    return {"format": LEGACY_FORMAT, "source": "dclm", "seq_len": L, "vocab_size": 1000, "dtype": "<u2",
            "tokenizer_sha256": "ab" * 32, "rows_per_shard": 3, "documents": 4, "stream_tokens": 60,
            "dropped_tokens": 2, "total_rows": 5, "shards": [_shard(0, 3), _shard(1, 2)]}


def mixture(rows=5):
    return {"format": MIXTURE_FORMAT, "dtype": "uint16", "seq_len": L, "requested_tokens": 100, "actual_tokens": 40,
            "global_batch_sequences": 8, "sources": [{"name": "dclm", "weight": 0.3, "rows": rows,
                                                     "trained_tokens": rows * L,
                                                     "manifest": "corpora/dclm/manifest.json"}]}


def test_both_formats_normalize_to_one_form():
    release = parse_source_manifest(release_source(), ORIGIN)
    legacy = parse_source_manifest(legacy_source(), "shards/dclm/manifest.json")
    for m in (release, legacy):
        assert (m.name, m.seq_len, m.dtype, m.rows) == ("dclm", L, "uint16", 5)
        assert [(s.file, s.rows, s.tokens, s.bytes) for s in m.shards] == [
            ("tokens-00000.bin", 3, 25, 50), ("tokens-00001.bin", 2, 17, 34)]
    assert release.tokenizer_sha256 is None and release.vocab_size is None
    assert (legacy.tokenizer_sha256, legacy.vocab_size) == ("ab" * 32, 1000)
    # readable as the JSON document: callers written against the manifest keys keep working
    assert legacy["total_rows"] == 5 and legacy["documents"] == 4 and legacy.get("tokenizer_sha256") == "ab" * 32
    assert release["source"] == "dclm" and release["shards"][1]["rows"] == 2 and release.get("vocab_size") is None
    assert release.shards[0] == _shard(0, 3) and isinstance(release.shards[0], Shard)
    assert isinstance(release, SourceManifest) and release.origin == ORIGIN


def _set(path, value):
    def change(doc):
        *parents, last = path
        target = doc
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return change


@pytest.mark.parametrize("change, field, needle", [
    (_set(["format"], "other-v2"), "format", "allowed"),
    (_set(["dtype"], "uint32"), "dtype", "allowed: 'uint16', '<u2'"),
    (_set(["shards"], "tokens-00000.bin"), "shards", "is a string; it must be a list"),
    (_set(["shards"], []), "shards", "is empty"),
    (_set(["shards", 0], "tokens-00000.bin"), "shards[0]", "must be a JSON object"),
    (_set(["shards", 0, "rows"], KeyError), "shards[0].rows", "is missing"),
    (_set(["shards", 0, "rows"], "sixteen"), "shards[0].rows", "'sixteen' (a string)"),
    (_set(["shards", 0, "rows"], True), "shards[0].rows", "(a boolean)"),
    (_set(["shards", 0, "rows"], 3.0), "shards[0].rows", "(a number)"),
    (_set(["seq_len"], "128"), "seq_len", "'128' (a string); it must be a JSON integer"),
    (_set(["seq_len"], True), "seq_len", "(a boolean)"),
    (_set(["shards", 0, "file"], "../../../victim.bin"), "shards[0].file", "without a directory part"),
    (_set(["shards", 0, "file"], "/etc/passwd"), "shards[0].file", "absolute path"),
    (_set(["shards", 1, "file"], "tokens-00000.bin"), "shards[1].file", "again (also shards[0])"),
    (_set(["shards", 0, "tokens"], 24), "shards[0].tokens", "rows·L+1 = 25"),
    (_set(["shards", 0, "bytes"], 49), "shards[0].bytes", "2·tokens = 50"),
    (_set(["shards", 0, "sha256"], KeyError), "shards[0].sha256", "is missing"),
    (_set(["shards", 0, "sha256"], "abc"), "shards[0].sha256", "64 lowercase hexadecimal"),
    (_set(["rows"], 6), "rows", "its shards hold 5 rows"),
    (_set(["rows"], KeyError), "rows", "is missing"),
    (_set(["source"], "../docs"), "source", "without a directory part"),
    (_set(["weight"], "heavy"), "weight", "finite number"),
])
def test_every_release_rule_and_malformed_value_names_the_file_and_field(change, field, needle):
    doc = release_source()
    change(doc)
    with pytest.raises(ManifestError) as info:
        parse_source_manifest(doc, ORIGIN)
    message = str(info.value)
    assert message.startswith(ORIGIN) and f"field {field!r}" in message and needle in message, message
    assert "ds-trhash data tokenize" in message  # how to fix it


def test_legacy_rules_hold_too():
    doc = legacy_source()
    doc["total_rows"] = 9
    with pytest.raises(ManifestError, match="field 'total_rows' is 9, but its shards hold 5 rows"):
        parse_source_manifest(doc, "m.json")
    doc = legacy_source()
    del doc["tokenizer_sha256"]  # our old format always recorded it
    with pytest.raises(ManifestError, match="field 'tokenizer_sha256' is missing"):
        parse_source_manifest(doc, "m.json")
    doc = legacy_source()
    del doc["dtype"]  # the oldest manifests: dtype implied
    assert parse_source_manifest(doc, "m.json").dtype == "uint16"


def test_a_manifest_not_an_object_and_another_source_are_refused():
    with pytest.raises(ManifestError, match=f"^{ORIGIN} must be a JSON object, got a list"):
        parse_source_manifest([], ORIGIN)
    with pytest.raises(ManifestError, match="field 'source' is 'dclm', but the manifest sits where source 'web'"):
        parse_source_manifest(release_source(), ORIGIN, expect_source="web")


def test_the_mixture_parses_and_agrees_with_its_sources():
    mix = parse_mixture_manifest(mixture(), "hf://datasets/o/r@abc/mixture_manifest.json")
    assert (mix.seq_len, mix.rows, [s.name for s in mix.sources]) == (L, 5, ["dclm"])
    source = parse_source_manifest(release_source(), ORIGIN)
    check_against_mixture(mix, {"dclm": source})
    with pytest.raises(ManifestError, match="field 'rows' of source 'dclm' is 6"):
        check_against_mixture(parse_mixture_manifest(mixture(rows=6), "mix.json"), {"dclm": source})
    other = copy.deepcopy(mixture())
    other["seq_len"] = 16
    with pytest.raises(ManifestError, match="'seq_len' is 8, but mix.json says 16"):
        check_against_mixture(parse_mixture_manifest(other, "mix.json"), {"dclm": source})
    with pytest.raises(ManifestError, match="lists source 'dclm', whose corpora/dclm/manifest.json is missing"):
        check_against_mixture(mix, {})


@pytest.mark.parametrize("change, needle", [
    (_set(["sources", 0, "manifest"], "../../etc/manifest.json"), "must be 'corpora/dclm/manifest.json'"),
    (_set(["sources", 0, "name"], "../docs"), "field 'sources[0].name'"),
    (_set(["sources", 0, "rows"], "5"), "field 'sources[0].rows' is '5'"),
    (_set(["sources"], {}), "field 'sources' is an object; it must be a list"),
    (_set(["dtype"], "int32"), "field 'dtype'"),
    (_set(["global_batch_sequences"], False), "field 'global_batch_sequences'"),
])
def test_malformed_mixtures_are_refused(change, needle):
    doc = mixture()
    change(doc)
    with pytest.raises(ManifestError, match="mix.json") as info:
        parse_mixture_manifest(doc, "mix.json")
    assert needle in str(info.value)
