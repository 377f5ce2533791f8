"""The one batch-layout formula: a step's rows cut micro-step by micro-step, rank by rank."""
from ds_trhash.batch_layout import micro_batch_start, step_rows


def test_every_row_of_a_step_belongs_to_exactly_one_rank_micro_step():
    mb, ga, world = 3, 2, 4
    starts = sorted(micro_batch_start(5, m, r, mb, ga, world) for m in range(ga) for r in range(world))
    assert starts == [5 * step_rows(mb, ga, world) + i * mb for i in range(ga * world)]
    assert micro_batch_start(1, 1, 1, 2, 2, 2) == 8 + (1 * 2 + 1) * 2  # micro-step 1 follows every rank's micro-step 0
