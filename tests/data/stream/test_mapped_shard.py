"""A shard mapped once: its rows cut from memory, a damaged size refused, its holder released once."""
import numpy as np
import pytest

from ds_trhash.data.formats.shards import ShardError, read_rows, write_shards
from ds_trhash.data.stream.mapped_shard import MappedShard

L, R = 4, 5  # seq_len, rows per shard


@pytest.fixture
def shard(tmp_path):
    write_shards("a", [np.arange(1, 1 + 3 * L + 1)], L, R, tmp_path, vocab_size=100, tokenizer_hash="h")
    return next((tmp_path / "a").glob("*.bin"))


def test_rows_are_cut_from_the_map_as_the_file_holds_them(shard):
    mapped = MappedShard(("a", shard.name), shard, L)
    assert (mapped.rows, mapped.size) == (3, (3 * L + 1) * 2)
    out = np.full((3, L + 1), -1, dtype=np.int64)
    mapped.read_into(out, positions=[2, 0], rows=[0, 2])  # out of order, as a shuffled micro-batch asks
    assert out[1].tolist() == [-1] * (L + 1)
    assert (out[[2, 0]] == read_rows(shard, [0, 2], L)).all()
    with pytest.raises(ShardError, match=f"row 3 is outside {shard}, which has 3 rows"):
        mapped.read_into(out, [0], [3])


def test_a_shard_of_the_wrong_size_is_refused_and_its_holder_released(shard, tmp_path):
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(shard.read_bytes()[:-2])  # one token short
    released = []
    with pytest.raises(ShardError, match=r"holds 12 tokens, not rows·4\+1; wrong seq_len or damaged shard"):
        MappedShard(("a", "damaged.bin"), damaged, L, on_release=lambda: released.append(1))
    assert released == [1]


def test_release_unmaps_and_tells_the_holder_once(shard):
    released = []
    mapped = MappedShard(("a", shard.name), shard, L, on_release=lambda: released.append(1))
    mapped.release()
    mapped.release()
    assert mapped.tokens is None and released == [1]
