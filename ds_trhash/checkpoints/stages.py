"""Stage guard: which checkpoint may start which stage (docs/contracts.md §3).

Every rule here is checked from plain data (the source checkpoint's record, the two plan
documents, the launch flags) so that a wrong launch fails in seconds, before a model or an
optimizer is allocated. The public trainer discovers a broken refinement only after building
the model; this module exists so that we never do.

This module depends on nothing else in the package: plan validation and fingerprinting are
injected by the caller (``ds_trhash.data.plans.plan``), which keeps the rules testable on their own.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ds_trhash.errors import UserError



class StageError(UserError, ValueError):
    """A launch that would start a stage from the wrong source; the message says how to fix it."""


class Stage(str, enum.Enum):
    PRETRAINING = "pretraining"
    REFINEMENT = "refinement"
    SUPERVISED_FINETUNING = "supervised-finetuning"

    @classmethod
    def parse(cls, value: "str | Stage", *, what: str = "stage") -> "Stage":
        """Accept the spelling used in configs and checkpoints; name the allowed ones otherwise."""
        if isinstance(value, Stage):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(s.value for s in cls)
            raise StageError(f"unknown {what} {value!r}; allowed: {allowed}") from None


@dataclass(frozen=True)
class Transition:
    """What a source→target move demands beyond the stages themselves."""

    same_corpus: bool = False
    fresh_optimizer: bool = False


# docs/contracts.md §3. Pretraining never appears as a target: a pretraining run starts from scratch and
# continues only through --resume.
ALLOWED_TRANSITIONS: Mapping[tuple[Stage, Stage], Transition] = {
    (Stage.PRETRAINING, Stage.REFINEMENT): Transition(same_corpus=True, fresh_optimizer=True),
    (Stage.REFINEMENT, Stage.SUPERVISED_FINETUNING): Transition(),
    (Stage.SUPERVISED_FINETUNING, Stage.SUPERVISED_FINETUNING): Transition(),
}


@dataclass(frozen=True)
class Family:
    """Per-family stage rules, so that no code elsewhere branches on a family name.

    ``integrated_refinement``: the family's own pretraining recipe already contains the
    refinement pass, so its pretraining checkpoints may feed SFT directly.
    """

    integrated_refinement: bool = False

    def transitions(self) -> dict[tuple[Stage, Stage], Transition]:
        table = dict(ALLOWED_TRANSITIONS)
        if self.integrated_refinement:
            table[(Stage.PRETRAINING, Stage.SUPERVISED_FINETUNING)] = Transition()
        return table

    def sources_for(self, target: Stage) -> list[Stage]:
        return [src for (src, dst) in self.transitions() if dst == target]


FAMILIES: Mapping[str, Family] = {
    "language": Family(integrated_refinement=False),
    "vision": Family(integrated_refinement=True),
}


def family_rules(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise StageError(
            f"unknown model family {name!r}; allowed: {', '.join(sorted(FAMILIES))} (set model.family)"
        ) from None


@dataclass(frozen=True)
class SourceRecord:
    """What a checkpoint says about itself; read from its trainer_state.json or run.json.

    ``stage`` is None when the checkpoint records none (e.g. a bare SafeTensors file): the
    guard then refuses, because a stage that cannot be proven is not assumed.
    """

    stage: Stage | None
    plan_fingerprint: str | None = None
    lora: bool = False
    family: str | None = None
    path: str | None = None

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any], *, path: str | None = None) -> "SourceRecord":
        stage = doc.get("stage")
        return cls(
            stage=None if stage is None else Stage.parse(stage, what=f"stage recorded in {path or 'checkpoint'}"),
            plan_fingerprint=doc.get("plan_fingerprint"),
            lora=bool(doc.get("lora", False)),
            family=doc.get("family"),
            path=path,
        )

    def describe(self) -> str:
        return self.path or "the source checkpoint"


def _fix_for(source: Stage, target: Stage, family: str) -> str:
    if target == Stage.PRETRAINING:
        return ("pretraining starts from scratch: drop --init-checkpoint; to continue an interrupted "
                "pretraining run use --resume")
    if source == Stage.PRETRAINING and target == Stage.SUPERVISED_FINETUNING:
        return ("run refinement first (stage: refinement, --init-checkpoint <pretraining checkpoint>, "
                "the refinement plan of the same corpus), then start SFT from the refinement checkpoint")
    allowed = sorted(f"{a.value} -> {b.value}" for a, b in family_rules(family).transitions())
    return f"allowed transitions for family {family!r}: {'; '.join(allowed)}"


def _check_sft_flag(flag: str | None, source: SourceRecord, family: Family) -> None:
    allowed = family.sources_for(Stage.SUPERVISED_FINETUNING)
    names = ", ".join(s.value for s in allowed)
    if flag is None:
        raise StageError(f"an SFT launch must declare its source stage with --source-stage; allowed: {names}")
    declared = next((s for s in Stage if s.value == flag), None)
    if declared not in allowed:
        raise StageError(f"--source-stage {flag!r} is not allowed for SFT; allowed: {names}")
    if source.stage is not None and declared != source.stage:
        raise StageError(
            f"--source-stage {flag} does not match {source.describe()}, which records stage "
            f"{source.stage.value!r}; pass --source-stage {source.stage.value} or choose the right checkpoint"
        )


def _check_same_corpus(
    source: SourceRecord,
    target_plan_doc: Mapping | None,
    source_plan_doc: Mapping | None,
    validate_refinement: Callable[[Mapping, Mapping], Any],
    plan_fingerprint: Callable[[Mapping], str],
) -> None:
    if target_plan_doc is None or source_plan_doc is None:
        missing = "the refinement plan" if target_plan_doc is None else "the pretraining plan"
        raise StageError(f"refinement needs both plans to prove the same corpus, but {missing} was not given")
    if source.plan_fingerprint is None:
        raise StageError(
            f"{source.describe()} records no plan fingerprint, so its corpus cannot be proven; "
            "start refinement from a checkpoint written by this trainer (trainer_state.json) or an export "
            "whose run.json carries plan_fingerprint"
        )
    pre_fp = plan_fingerprint(source_plan_doc)
    if pre_fp != source.plan_fingerprint:
        raise StageError(
            f"the pretraining plan given has fingerprint {pre_fp}, but {source.describe()} was trained on "
            f"{source.plan_fingerprint}; pass the plan the checkpoint was trained with"
        )
    ref_fp = plan_fingerprint(target_plan_doc)
    if ref_fp != source.plan_fingerprint:
        raise StageError(
            f"refinement must replay the same corpus: refinement plan fingerprint {ref_fp} != pretraining "
            f"fingerprint {source.plan_fingerprint}; derive the refinement plan from the pretraining plan"
        )
    try:
        validate_refinement(target_plan_doc, source_plan_doc)
    except UserError as exc:  # the plan module's own refusal (PlanError); a bug keeps its traceback
        raise StageError(f"the refinement plan is not a valid refinement of the pretraining plan: "
                         f"{type(exc).__name__}: {exc}") from exc


def check_launch(
    target: Stage | str,
    source: SourceRecord | None,
    *,
    source_stage_flag: str | None,
    target_plan_doc: Mapping | None,
    source_plan_doc: Mapping | None,
    fresh_optimizer: bool,
    family: str,
    validate_refinement: Callable[[Mapping, Mapping], Any],
    plan_fingerprint: Callable[[Mapping], str],
) -> None:
    """Refuse a launch whose target stage cannot start from ``source`` (None = from scratch).

    ``source`` is the --init-checkpoint record. A resumed run passes the same record as its
    first launch did: the guard is idempotent, and resume compatibility is a separate check
    (``checkpoint.check_resume_compatible``).
    """
    target = Stage.parse(target, what="target stage")
    rules = family_rules(family)

    if source is None:
        if target == Stage.PRETRAINING:
            return
        raise StageError(
            f"{target.value} needs a source checkpoint (--init-checkpoint); allowed sources: "
            f"{', '.join(s.value for s in rules.sources_for(target))}"
        )

    if source.family is not None and source.family != family:
        raise StageError(
            f"{source.describe()} is a {source.family!r} model but this launch is family {family!r}; "
            "set model.family to match or choose another checkpoint"
        )
    if source.stage is None:
        raise StageError(
            f"{source.describe()} records no stage, so the {target.value} launch cannot be checked; "
            "add a run.json {\"stage\": ...} beside model.safetensors or use a checkpoint written by this trainer"
        )
    transition = rules.transitions().get((source.stage, target))
    if transition is None:
        raise StageError(
            f"{source.stage.value} -> {target.value} is not an allowed transition; "
            f"{_fix_for(source.stage, target, family)}"
        )
    if target == Stage.SUPERVISED_FINETUNING:
        _check_sft_flag(source_stage_flag, source, rules)
    if transition.fresh_optimizer and not fresh_optimizer:
        raise StageError(
            f"{source.stage.value} -> {target.value} must start with a fresh optimizer; load weights only "
            "(--init-checkpoint), not the optimizer state"
        )
    if transition.same_corpus:
        _check_same_corpus(source, target_plan_doc, source_plan_doc, validate_refinement, plan_fingerprint)
