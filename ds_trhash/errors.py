"""The one base class of every expected refusal.

A user error is a launch, a command or an input that cannot be carried out as given: a bad
config key, a plan that fails its checks, a checkpoint that does not match. It is reported as a
single line naming what is wrong and how to fix it, and exits with status 2. Any other exception
is a bug and keeps its traceback. This module imports nothing of ours, so every package can
derive its errors from it.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An expected refusal: printed as one line, exit status `exit_code`."""

    exit_code: int = EXIT_USER_ERROR
