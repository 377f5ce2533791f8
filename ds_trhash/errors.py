"""The one base class of every expected refusal.

A user error is a launch, a command or an input that cannot be carried out as given: a bad
config key, a plan that fails its checks, a checkpoint that does not match. It is reported as a
single line naming what is wrong and how to fix it, and exits with status ``exit_code`` (2
unless the class says otherwise). Any other exception is a bug and keeps its traceback.

Two places turn a user error into its message and exit code: ``ds_trhash.cli.main`` for every
``ds-trhash`` command and ``ds_trhash.training.entrypoint.main`` for a training launch. Code below
them raises; it never prints an error and returns 2 itself. This module imports nothing of ours,
so every package can derive its errors from it.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An expected refusal: printed as one line, exit status `exit_code`."""

    exit_code: int = EXIT_USER_ERROR
    # True for an error each rank reports for itself: one met alone in the middle of a run (a read
    # of the node's data, a store that stayed away), or one every node's terminal must show (the
    # nodes' layout): every rank prints its own line; otherwise rank 0 speaks for all.
    per_rank: bool = False

    def message_lines(self) -> list[str]:
        """What the handler prints after ``error:``: the message on one line (a message built
        over several lines is joined). A class with details to list (one line per differing file)
        returns them after the first."""
        return [" ".join(str(self).split())]
