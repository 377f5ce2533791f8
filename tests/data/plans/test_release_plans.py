"""The three released replay plans: they load, carry the published fingerprints, the corrected
plan (replays outside the unique core) is valid, refinement is accepted or refused exactly as
published, and budgets/steps/token packs come out right at the plans' own seq_len."""

from pathlib import Path

import pytest

from ds_trhash.data.plans.budget import BudgetError, check_target_tokens, pack_boundaries, plan_steps
from ds_trhash.data.plans.plan import PlanError, check_refinement, derive_refinement, load_plan, validate_refinement
from tests.fail_closed import assert_clean_refusal, ds_trhash, tree_digest

# Byte-for-byte copies of the public plan files of the release.
RELEASED = Path(__file__).resolve().parent / "release_plans"

REPLAY, CORRECTED, PHASE2 = "tr_hash_70b_quality_replay.json", "tr_hash_70b_quality_replay_corrected.json", \
    "tr_hash_70b_unique_only_phase2.json"
FINGERPRINTS = {
    REPLAY: "b8549c92137b7ee14c01229ec2569afc153299dedc69109a8856adf4d4547d98",
    PHASE2: "b8549c92137b7ee14c01229ec2569afc153299dedc69109a8856adf4d4547d98",
    CORRECTED: "44bc8ef475bcd3af5cc593903a8bb24b21c0425ff2b4adf30543c88b5bd1be0a",
}
TOKENS_PER_STEP = 786_432  # the released run: 768 rows of 1024 tokens per optimizer step


@pytest.fixture(scope="module")
def plans():
    return {name: load_plan(RELEASED / name) for name in FINGERPRINTS}


def test_every_released_plan_loads_with_its_published_fingerprint(plans):
    assert {name: p.fingerprint for name, p in plans.items()} == FINGERPRINTS
    assert plans[REPLAY].trained_tokens == 129_995_112_448 and plans[REPLAY].unique_tokens == 69_997_690_880


def test_the_corrected_plan_with_replays_outside_the_core_is_valid(plans):
    corrected = plans[CORRECTED]
    core_tokens = sum(corrected.doc["source_unique_tokens"].values())
    assert corrected.unique_tokens > core_tokens and isinstance(corrected.doc["correction"], dict)
    assert corrected.trained_tokens == plans[REPLAY].trained_tokens
    # Its replays use shards the core never touched, so no one-pass refinement shares its fingerprint.
    with pytest.raises(PlanError, match="outside its unique core"):
        derive_refinement(corrected)


def test_phase2_refines_the_replay_plan_and_not_the_corrected_one(plans):
    validate_refinement(plans[PHASE2], plans[REPLAY])
    assert all(r.ok for r in check_refinement(plans[PHASE2], plans[REPLAY]))
    assert derive_refinement(plans[REPLAY]) == plans[PHASE2].doc
    with pytest.raises(PlanError) as info:
        validate_refinement(plans[PHASE2], plans[CORRECTED])
    assert info.value.rule == "fingerprint"
    failed = [r.rule for r in check_refinement(plans[PHASE2], plans[CORRECTED]) if not r.ok]
    assert failed == ["fingerprint"]


def test_check_refinement_command_prints_the_verdict_and_each_rule():
    before = tree_digest(RELEASED)  # the command only reads
    ok = ds_trhash("data", "check-refinement", RELEASED / PHASE2, "--pretraining", RELEASED / REPLAY)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0].startswith("valid: ")
    rules = ["one_phase", "phase_name", "phase_passes", "trained_equals_unique", "source_passes", "fingerprint"]
    assert [line.split()[1].rstrip(":") for line in lines[1:]] == rules
    assert all(line.split()[0] == "ok" for line in lines[1:])
    bad = ds_trhash("data", "check-refinement", RELEASED / PHASE2, "--pretraining", RELEASED / CORRECTED)
    assert bad.returncode == 2 and "Traceback" not in bad.stdout + bad.stderr
    assert bad.stdout.splitlines()[0].startswith("refused: ")
    assert "FAIL fingerprint: refinement unique core fingerprint b8549c92" in bad.stdout
    assert "44bc8ef4" in bad.stdout
    missing = ds_trhash("data", "check-refinement", RELEASED / "nope.json", "--pretraining", RELEASED / REPLAY)
    assert_clean_refusal(missing, "does not exist")
    assert tree_digest(RELEASED) == before


def test_steps_and_token_packs_of_the_released_plan_at_its_own_seq_len(plans):
    pre, ref = plans[REPLAY], plans[PHASE2]
    assert pre.seq_len == 1024 and TOKENS_PER_STEP % pre.seq_len == 0
    # Rounded down: 129,995,112,448 / 786,432 = 165,297.33 -> 165,297 steps, never the 165,298th.
    assert plan_steps(pre, TOKENS_PER_STEP) == 165_297
    assert plan_steps(pre, TOKENS_PER_STEP) * TOKENS_PER_STEP <= pre.trained_tokens
    assert plan_steps(ref, TOKENS_PER_STEP) == 89_006  # refinement: the unique core once
    with pytest.raises(BudgetError, match="automatic dataset repetition is forbidden"):
        plan_steps(pre, TOKENS_PER_STEP, requested_steps=165_298)
    with pytest.raises(BudgetError, match="whole number of 1024-token rows"):
        plan_steps(pre, TOKENS_PER_STEP + 512)
    assert check_target_tokens(pre, "129,995,112,448") == pre.trained_tokens
    with pytest.raises(BudgetError, match="TARGET_TOKENS 130000000000 != the plan's trained_tokens 129995112448"):
        check_target_tokens(pre, "130000000000")
    packs = pack_boundaries(165_297, 40)
    assert len(packs) == 40 and packs[0] == 4_133 and packs[19] == 82_649 and packs[-1] == 165_297
    assert all(b - a >= 1 for a, b in zip([0] + packs, packs))
