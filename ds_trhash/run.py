"""What a training launch is made of: the one place that composes training with evaluation.

Training defines the loop and the callback interface; evaluation and release implement callbacks on it;
neither imports the other's upper half. This module, above both, decides which callbacks a
launch gets (every part reads its own config section and stays off when that section says so)
and is what ``launch/train.py`` runs.
"""
from __future__ import annotations

from ds_trhash.eval.callbacks import EVAL_CALLBACKS, EVAL_USER_ERRORS
from ds_trhash.release.cleanup import CleanupRefused
from ds_trhash.release.export import ExportError
from ds_trhash.release.lifecycle import LIFECYCLE_CALLBACKS
from ds_trhash.training import launcher
from ds_trhash.training.callbacks import Callback, training_parts


def launch_parts() -> list[type[Callback]]:
    """Every callback class of a launch, in the order the loop calls them: training's with
    evaluation slotted in, then the end of a completed stage (final/, completion, cleanup)."""
    return [*training_parts(evaluation=EVAL_CALLBACKS), *LIFECYCLE_CALLBACKS]


def main(argv: list[str] | None = None) -> int:
    return launcher.main(argv, parts=launch_parts(), user_errors=(*EVAL_USER_ERRORS, ExportError, CleanupRefused))
