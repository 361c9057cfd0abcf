"""Contract: the slow-files-first list the test command's two workers schedule by names existing test files only
(a renamed file would silently fall back to collection order)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SLOW_FIRST

TESTS = Path(__file__).resolve().parent


def test_slow_first_names_existing_test_files_once():
    assert len(set(SLOW_FIRST)) == len(SLOW_FIRST)
    missing = [name for name in SLOW_FIRST if not (TESTS / name).is_file()]
    assert not missing, missing
