"""Stage guard: every allowed and refused transition, checked from plain data before any model."""
import hashlib
import json

import pytest

from ds_trhash.checkpoints.stages import (
    ALLOWED_TRANSITIONS,
    FAMILIES,
    SourceRecord,
    Stage,
    StageError,
    check_launch,
)
from ds_trhash.errors import UserError

PRE, REF, SFT = Stage.PRETRAINING, Stage.REFINEMENT, Stage.SUPERVISED_FINETUNING


class PlanProblem(UserError, ValueError):
    """Stands for the plan module's refusal (PlanError): a user error."""


def fingerprint(doc):
    return hashlib.sha256(json.dumps(doc["core"], sort_keys=True).encode()).hexdigest()


def accept_refinement(ref, pre):
    return None


PRE_PLAN = {"core": {"rows": [1, 2, 3]}, "phases": ["unique_core", "replay"]}
REF_PLAN = {"core": {"rows": [1, 2, 3]}, "phases": ["unique_core"]}


def launch(target, source, *, flag=None, ref=REF_PLAN, pre=PRE_PLAN, fresh=True, family="language",
           validate=accept_refinement):
    return check_launch(target, source, source_stage_flag=flag, target_plan_doc=ref, source_plan_doc=pre,
                        fresh_optimizer=fresh, family=family, validate_refinement=validate,
                        plan_fingerprint=fingerprint)


def record(stage, **kw):
    kw.setdefault("plan_fingerprint", fingerprint(PRE_PLAN))
    return SourceRecord(stage=stage, **kw)


def test_table_matches_spec():
    assert set(ALLOWED_TRANSITIONS) == {(PRE, REF), (REF, SFT), (SFT, SFT)}
    assert all(target != PRE for _, target in ALLOWED_TRANSITIONS)
    assert (PRE, SFT) in FAMILIES["vision"].transitions()
    assert (PRE, SFT) not in FAMILIES["language"].transitions()


def test_pretraining_from_scratch_is_allowed():
    launch(PRE, None, ref=None, pre=None)


@pytest.mark.parametrize("source_stage", list(Stage))
def test_pretraining_is_never_a_target(source_stage):
    with pytest.raises(StageError, match="not an allowed transition.*drop --init-checkpoint.*--resume"):
        launch(PRE, record(source_stage))


def test_pretraining_to_refinement_allowed():
    launch(REF, record(PRE))


def test_refinement_requires_fresh_optimizer():
    with pytest.raises(StageError, match="fresh optimizer"):
        launch(REF, record(PRE), fresh=False)


def test_refinement_requires_a_source_checkpoint():
    with pytest.raises(StageError, match="refinement needs a source checkpoint.*--init-checkpoint.*pretraining"):
        launch(REF, None)


@pytest.mark.parametrize("source_stage", [REF, SFT])
def test_refinement_only_from_pretraining(source_stage):
    with pytest.raises(StageError, match=f"{source_stage.value} -> refinement is not an allowed"):
        launch(REF, record(source_stage))


def test_refinement_refused_when_refinement_plan_fingerprint_differs():
    changed = {"core": {"rows": [1, 2, 4]}, "phases": ["unique_core"]}
    with pytest.raises(StageError, match="same corpus.*refinement plan fingerprint"):
        launch(REF, record(PRE), ref=changed)


def test_refinement_refused_when_pretraining_plan_is_not_the_checkpoints():
    other = {"core": {"rows": [9]}, "phases": ["unique_core"]}
    with pytest.raises(StageError, match="was trained on"):
        launch(REF, record(PRE), pre=other, ref=other)


def test_refinement_refused_when_checkpoint_records_no_fingerprint():
    with pytest.raises(StageError, match="records no plan fingerprint"):
        launch(REF, record(PRE, plan_fingerprint=None))


@pytest.mark.parametrize("missing", ["ref", "pre"])
def test_refinement_refused_without_both_plans(missing):
    with pytest.raises(StageError, match="needs both plans"):
        launch(REF, record(PRE), **{missing: None})


def test_refinement_validator_error_is_wrapped_and_named():
    def reject(ref, pre):
        raise PlanProblem("refinement plan has 2 phases; exactly one (unique_core) is allowed")

    with pytest.raises(StageError, match="not a valid refinement.*PlanProblem.*2 phases") as info:
        launch(REF, record(PRE), validate=reject)
    assert isinstance(info.value.__cause__, PlanProblem)


def test_a_bug_in_the_refinement_validator_keeps_its_traceback():
    def broken(ref, pre):
        raise KeyError("phases")  # not a refusal: the stage guard must not dress it up as one

    with pytest.raises(KeyError):
        launch(REF, record(PRE), validate=broken)


def test_validator_receives_refinement_then_pretraining_plan():
    seen = []
    launch(REF, record(PRE), validate=lambda ref, pre: seen.append((ref, pre)))
    assert seen == [(REF_PLAN, PRE_PLAN)]


@pytest.mark.parametrize("source_stage", [REF, SFT])
def test_sft_from_refinement_or_sft(source_stage):
    launch(SFT, record(source_stage), flag=source_stage.value, fresh=False)


@pytest.mark.parametrize("flag", [None, "pretraining", "refinement"])
def test_direct_pretraining_to_sft_refused_with_fix(flag):
    with pytest.raises(StageError, match="pretraining -> supervised-finetuning is not an allowed transition; "
                                         "run refinement first"):
        launch(SFT, record(PRE), flag=flag)


def test_vision_family_may_go_pretraining_to_sft():
    launch(SFT, record(PRE, family="vision"), flag="pretraining", family="vision")


def test_unknown_family_refused():
    with pytest.raises(StageError, match="unknown model family 'audio'.*language, vision"):
        launch(PRE, None, family="audio")


def test_family_mismatch_refused():
    with pytest.raises(StageError, match="is a 'vision' model but this launch is family 'language'"):
        launch(SFT, record(REF, family="vision"), flag="refinement")


@pytest.mark.parametrize("flag", [None, "pretrain", "pretraining"])
def test_sft_source_stage_flag_missing_or_other(flag):
    with pytest.raises(StageError, match="refinement, supervised-finetuning"):
        launch(SFT, record(REF), flag=flag)


def test_sft_flag_must_equal_recorded_stage():
    with pytest.raises(StageError, match="--source-stage supervised-finetuning does not match.*'refinement'"):
        launch(SFT, record(REF), flag="supervised-finetuning")


def test_sft_without_source_refused():
    with pytest.raises(StageError, match="supervised-finetuning needs a source checkpoint"):
        launch(SFT, None, flag="refinement")


def test_source_without_recorded_stage_refused():
    with pytest.raises(StageError, match="records no stage.*run.json"):
        launch(SFT, SourceRecord(stage=None, path="/x/export"), flag="refinement")


def test_unknown_target_stage_refused():
    with pytest.raises(StageError, match="unknown target stage 'sft'; allowed: pretraining, refinement"):
        launch("sft", None)


def test_source_record_from_checkpoint_state():
    rec = SourceRecord.from_mapping({"stage": "refinement", "plan_fingerprint": "ab", "lora": True,
                                     "family": "language"}, path="ck")
    assert rec == SourceRecord(Stage.REFINEMENT, "ab", True, "language", "ck")
    with pytest.raises(StageError, match="unknown stage recorded in ck"):
        SourceRecord.from_mapping({"stage": "warmup"}, path="ck")
