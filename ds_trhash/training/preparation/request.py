"""What the person who launched asked for: the command line and the environment, read once.

The entry point (``training.entrypoint.launch_request``, ``ds-trhash preflight``) turns the parsed
flags and the variables a launch honours (``RESUME``, ``TARGET_TOKENS``) into one frozen
``LaunchRequest``; everything below it (the output side, the plan, the trainer) takes that and
never reads ``argparse`` or ``os.environ`` for them. A test builds one directly.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchRequest:
    """One launch's request. ``overrides``: the config overrides in order (``--set`` values, then
    what the flags set); ``resume_flag`` and ``resume_env``: ``--resume`` and ``RESUME`` as given
    (two that disagree are refused by the output checks, naming both); ``target_tokens``: the
    ``TARGET_TOKENS`` variable, checked against the plan in place of ``data.target_tokens``."""

    config: str
    overrides: tuple[str, ...] = ()
    resume_flag: str | None = None
    resume_env: str | None = None
    init_checkpoint: str | None = None
    allow_fresh_over_damaged: bool = False
    fork: bool = False
    reshard: bool = False
    target_tokens: str | None = None

    @property
    def resume(self) -> str | None:
        """``--resume`` or else ``RESUME`` ("auto", a checkpoint directory), None for neither."""
        return self.resume_flag or self.resume_env or None

    @property
    def resumes_auto(self) -> bool:
        return self.resume == "auto"
