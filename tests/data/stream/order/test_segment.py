"""The WFQ order of a segment: the rows of a range placed at their ranks equal the one-row rank,
and sources past 2^31 rows (where int64 products could overflow) are placed exactly too."""
from ds_trhash.data.stream.order import Segment, SourceRows


def _segment(*totals):
    sources = tuple(SourceRows(f"s{i}", ("f0.bin", "f1.bin"), (0, total // 2), total) for i, total in enumerate(totals))
    return Segment(0, 0, 0, "p", sources)


def test_a_range_is_placed_at_the_ranks_of_its_rows():
    for segment in (_segment(23, 12), _segment(5, 7, 11), _segment(3 * 2**31 + 7, 2**32 - 1)):
        count = min(40, segment.length // 2)
        for a in {0, 1, segment.length // 3, segment.length - count}:
            rows = segment.order(a, a + count)
            assert len(rows) == count
            for offset, (name, file, row) in enumerate(rows):
                s = int(name[1:])
                k = row + (segment.sources[s].starts[1] if file == "f1.bin" else 0)
                assert segment.position(s, k) == a + offset, (segment.sources, a, offset)
