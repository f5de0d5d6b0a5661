"""Shared test setup: make tests/support.py importable everywhere, and start the slow tests first."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Helper modules whose asserts are the tests' own: rewritten for pytest's messages like test modules.
pytest.register_assert_rewrite("chain", "otelcol", "scrapecluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes seconds (a real process, a validator, a compile); run first")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, each group in its own order: with pytest-xdist the workers take them
    while the quick ones are still there to even out the end, instead of one worker finishing a
    long test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
