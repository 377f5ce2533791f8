"""tests/schedule.py names only what exists and every file that reads a launching session
fixture: a renamed or new file would otherwise have that fixture made on both workers without
any test failing."""
import re
from pathlib import Path

import pytest

from tests import schedule

REPO = Path(__file__).resolve().parents[1]


def test_every_grouped_or_first_file_exists():
    assert all((REPO / path).is_file() for path in schedule.SHARED)
    assert all((REPO / path).is_file() for path in schedule.FIRST)
    assert len(set(schedule.FIRST)) == len(schedule.FIRST)
    assert all(schedule.unit_of(path) == path for path in schedule.FIRST)  # whole units, not grouped files


def _readers(fixture: str) -> set[str]:
    """Test files with a test that takes ``fixture`` as an argument."""
    pattern = re.compile(rf"^def test_\w+\([^)]*\b{fixture}\b", re.M)
    return {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py") if pattern.search(p.read_text())}


@pytest.mark.parametrize("fixture", ["prelaunch_runs", "supervised"])  # the session fixtures that start launches
def test_the_files_reading_a_launching_session_fixture_are_one_unit(fixture):
    readers = _readers(fixture)
    assert len(readers) >= 2, readers
    assert len({schedule.unit_of(path) for path in readers}) == 1, readers
