"""How `make test` spreads the suite over its two xdist workers (``--dist loadfile``, with the
scheduler of tests/conftest.py).

A work unit is a group of whole test files: one file by default (its module fixtures run once),
or several files that read one session fixture (so that it is made on one worker, not on both).
Units start longest first, so that the last ones to finish are short; otherwise (as with
xdist's default order, by test count) the one-test launch files come last, and one worker
ends minutes before the other.

The order is a hint for the wall time and nothing else: every test runs whatever its place.
The seconds below are what each unit took in a `make test` of this suite (``--durations``) on
the 2-core machine, rounded.
"""
from __future__ import annotations

# files that read the same session fixture: one unit
SHARED = {
    "tests/prelaunch/test_preflight.py": "prelaunch",  # prelaunch_runs (tests/prelaunch/runs.py)
    "tests/prelaunch/test_smoke.py": "prelaunch",
    "tests/ops/test_jobs.py": "ops-supervised",  # supervised (tests/ops/conftest.py)
    "tests/ops/test_report.py": "ops-supervised",
}

# The listed units in the order they start: longest first (seconds each took, measured as
# above), except that the exact-resume file leads and the two files that read the 2-process
# reference it makes (shared_launches) follow a little later, so that whichever worker asks
# for that reference next finds it made instead of waiting for it.
ORDER = (
    "tests/training/test_resume_equivalence.py",  # 170 s
    "tests/training/test_sft_stage.py",  # 170
    "prelaunch",  # 140
    "tests/checkpoints/test_reshard.py",  # 90, reads the reference
    "tests/training/test_launch_refusals.py",  # 125
    "tests/training/test_launch.py",  # 110
    "tests/training/test_stream_launch.py",  # 40, reads the reference
    "ops-supervised",  # 80
    "tests/training/test_expert_parallel_launch.py",  # 80
    "tests/training/test_stop_signals.py",  # 77
    "tests/release/test_lifecycle.py",  # 61
    "tests/training/test_multinode.py",  # 58
    "tests/training/test_disk_failures.py",  # 50
    "tests/release/test_watch.py",  # 43
    "tests/training/test_compile_launch.py",  # 38
    "tests/training/test_release_layout_launch.py",  # 28
    "tests/training/test_engine.py",  # 23
    "tests/bench/test_bench_step.py",  # 20
    "tests/release/test_generate.py",  # 16
    "tests/training/test_release_recipe.py",  # 15
    "tests/training/test_loop.py",  # 15
)


def unit_of(path: str) -> str:
    """The work unit of a test file (its path relative to the repository root)."""
    return SHARED.get(path, path)


def rank(unit: str) -> int:
    """Sort key of a unit: its place in ORDER; every unit not listed after them (a stable sort
    keeps those in collection order)."""
    return ORDER.index(unit) if unit in ORDER else len(ORDER)
