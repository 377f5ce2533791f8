"""tests/schedule.py names only what exists: a renamed file would otherwise lose its place (or
its shared session fixture would be made on both workers) without any test failing."""
import re
from pathlib import Path

import pytest

from tests import schedule

REPO = Path(__file__).resolve().parents[1]


def test_every_scheduled_file_exists_and_every_unit_is_a_file_or_a_shared_group():
    assert all((REPO / path).is_file() for path in schedule.SHARED)
    groups = set(schedule.SHARED.values())
    for unit in schedule.ORDER:
        assert unit in groups or (REPO / unit).is_file(), unit
    assert len(set(schedule.ORDER)) == len(schedule.ORDER)


def _readers(fixture: str) -> set[str]:
    """Test files with a test that takes ``fixture`` as an argument."""
    pattern = re.compile(rf"^def test_\w+\([^)]*\b{fixture}\b", re.M)
    return {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py") if pattern.search(p.read_text())}


@pytest.mark.parametrize("fixture", ["prelaunch_runs", "supervised"])  # the session fixtures that start launches
def test_the_files_reading_a_launching_session_fixture_are_one_unit(fixture):
    readers = _readers(fixture)
    assert len(readers) >= 2, readers
    assert len({schedule.unit_of(path) for path in readers}) == 1, readers


def test_the_files_reading_the_shared_reference_start_after_the_file_that_makes_it_first():
    maker = schedule.rank("tests/training/test_resume_equivalence.py")
    assert maker == 0
    assert schedule.rank("tests/checkpoints/test_reshard.py") > maker
    assert schedule.rank("tests/data/test_manifest.py") == len(schedule.ORDER)
