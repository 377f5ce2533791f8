import math

import pytest

from ds_trhash.data.plans.budget import BudgetError, check_target_tokens, pack_boundaries, plan_steps

RELEASED = {"trained_tokens": 129_995_112_448, "unique_tokens": 69_997_690_880, "seq_len": 2048}
TOKENS_PER_STEP = 786_432  # 384 rows of 2,048 tokens


def test_released_run_steps_round_down_and_never_exceed_the_plan():
    steps = plan_steps(RELEASED, TOKENS_PER_STEP)
    # 129,995,112,448 / 786,432 = 165,297.33...: 165,297 whole steps, 262,144 tokens left over.
    assert steps == 165_297
    assert steps * TOKENS_PER_STEP == 129_994_850_304 <= RELEASED["trained_tokens"]
    assert (steps + 1) * TOKENS_PER_STEP > RELEASED["trained_tokens"]
    assert RELEASED["trained_tokens"] - steps * TOKENS_PER_STEP == 262_144
    with pytest.raises(BudgetError, match="automatic dataset repetition is forbidden"):
        plan_steps(RELEASED, TOKENS_PER_STEP, requested_steps=steps + 1)  # the public trainer's rounding up


def test_fewer_steps_than_the_plan_are_allowed():
    assert plan_steps(RELEASED, TOKENS_PER_STEP, requested_steps=1000) == 1000
    assert plan_steps({"trained_tokens": 100 * 16, "seq_len": 16}, 4 * 16) == 25


@pytest.mark.parametrize(
    "doc, tokens_per_step, requested, message",
    [
        ({"trained_tokens": 3 * 16, "seq_len": 16}, 4 * 16, None, "do not fill one step"),
        ({"trained_tokens": 100 * 16, "seq_len": 16}, 4 * 16, 26, "automatic dataset repetition is forbidden"),
        ({"trained_tokens": 100 * 16, "seq_len": 16}, 4 * 16, 0, "must be positive"),
        ({"trained_tokens": 100 * 16, "seq_len": 16}, 40, None, "not a whole number of 16-token rows"),
        ({"trained_tokens": 100 * 16, "seq_len": 16}, 0, None, "must be positive"),
    ],
)
def test_step_errors(doc, tokens_per_step, requested, message):
    with pytest.raises(BudgetError, match=message):
        plan_steps(doc, tokens_per_step, requested_steps=requested)


def test_target_tokens_must_match_the_plan_exactly():
    assert check_target_tokens(RELEASED, None) is None
    assert check_target_tokens(RELEASED, "  ") is None
    assert check_target_tokens(RELEASED, "129995112448") == RELEASED["trained_tokens"]
    assert check_target_tokens(RELEASED, "129,995,112,448") == RELEASED["trained_tokens"]
    assert check_target_tokens(RELEASED, 129_995_112_448) == RELEASED["trained_tokens"]
    with pytest.raises(BudgetError) as info:
        check_target_tokens(RELEASED, "130000000000")
    assert "130000000000" in str(info.value) and "129995112448" in str(info.value)
    assert "fix the plan or unset TARGET_TOKENS" in str(info.value)
    with pytest.raises(BudgetError, match="not an integer"):
        check_target_tokens(RELEASED, "130B")


def test_pack_boundaries_are_ceilings_and_every_pack_has_a_step():
    assert pack_boundaries(10, 4) == [3, 5, 8, 10]
    assert pack_boundaries(3, 40) == [1, 2, 3]
    steps = 165_297
    bounds = pack_boundaries(steps)
    assert len(bounds) == 40 and bounds[-1] == steps
    assert bounds == [math.ceil(i * steps / 40) for i in range(1, 41)]
    assert bounds[0] == 4133
    for total in range(1, 90):
        for packs in (1, 7, 40):
            b = pack_boundaries(total, packs)
            assert len(b) == min(total, packs) and b[-1] == total
            assert all(later > earlier for earlier, later in zip([0] + b, b))
    with pytest.raises(BudgetError):
        pack_boundaries(0)
    with pytest.raises(BudgetError):
        pack_boundaries(10, 0)


def test_the_message_names_where_the_target_came_from():
    with pytest.raises(BudgetError, match=r"^data.target_tokens 5 != the plan's trained_tokens .* unset data.target_tokens$"):
        check_target_tokens(RELEASED, 5, name="data.target_tokens")
    with pytest.raises(BudgetError, match="^TARGET_TOKENS 5 !="):
        check_target_tokens(RELEASED, "5")
