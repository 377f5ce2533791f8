"""The tokenize work directory: chunk files and their completion records, identity checks."""
import numpy as np
import pytest

from ds_trhash.data.build.chunk_store import ChunkStore, WorkDirError
from tests.fail_closed import tree_digest


def test_a_chunk_round_trips_and_counts_only_when_whole(tmp_path):
    store = ChunkStore(tmp_path / "w")
    store.claim({"seq_len": 8, "inputs": ["a"]})
    docs = [np.array([5, 6, 0], np.uint16), np.array([0], np.uint16), np.array([7, 8, 9, 0], np.uint16)]
    record = store.write(3, [len(d) for d in docs], np.concatenate(docs), {"records": 4, "inputs": {}, "bad": []})
    assert record["documents"] == 3 and record["tokens"] == 8 and record["bytes"] == 3 * 4 + 8 * 2
    assert store.verified(3) == record and store.verified(2) is None
    assert [d.tolist() for d in store.documents(3)] == [d.tolist() for d in docs]
    data = tmp_path / "w" / "c-00000003.bin"
    data.write_bytes(data.read_bytes()[:-2] + b"\1\0")
    assert store.verified(3) is None
    with pytest.raises(WorkDirError, match="does not match its record"):
        list(store.documents(3))
    data.write_bytes(data.read_bytes()[:-2])
    assert store.verified(3) is None
    (tmp_path / "w" / "c-00000003.json").write_text('{"chunk": 3, "docu')  # torn by a power loss
    assert store.verified(3) is None
    with pytest.raises(WorkDirError, match="lacks chunk 4"):
        list(store.documents(4))


def test_claim_refuses_another_identity_naming_each_difference(tmp_path):
    store = ChunkStore(tmp_path / "w")
    store.claim({"seq_len": 8, "inputs": ["a"]})
    store.claim({"seq_len": 8, "inputs": ["a"]})  # the same command continues
    before = tree_digest(tmp_path)
    with pytest.raises(WorkDirError) as err:
        store.claim({"seq_len": 16, "inputs": ["a"], "part": [0, 2]})
    assert "part: None (partial run) vs [0, 2] (this command); seq_len: 8 (partial run) vs 16" in str(err.value)
    assert tree_digest(tmp_path) == before
    with pytest.raises(WorkDirError, match="is not a tokenize work directory"):
        ChunkStore(tmp_path / "nothing").identity()
