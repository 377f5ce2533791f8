"""How `make test` spreads the suite over its two xdist workers (``--dist loadfile``, with the
scheduler of tests/conftest.py).

A work unit is a group of whole test files: one file by default (its module fixtures run once),
or several files that read one session fixture (so that it is made on one worker, not on both).
Units start in xdist's order (most tests first). Starting the longest launch files first was
tried and was no faster: 974 s of pytest, against 978 s for this order a little later and
850 s for it earlier the same day (the machine's load moves the suite's time by more than the
order does), so the simpler order stays.
"""
from __future__ import annotations

# files that read the same session fixture: one unit
SHARED = {
    "tests/prelaunch/test_preflight.py": "prelaunch",  # prelaunch_runs (tests/prelaunch/runs.py)
    "tests/prelaunch/test_smoke.py": "prelaunch",
    "tests/ops/test_jobs.py": "ops-supervised",  # supervised (tests/ops/conftest.py)
    "tests/ops/test_report.py": "ops-supervised",
}


def unit_of(path: str) -> str:
    """The work unit of a test file (its path relative to the repository root)."""
    return SHARED.get(path, path)
