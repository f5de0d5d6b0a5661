"""Shared test setup: make tests/support.py importable everywhere, and start the slow tests first."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Helper modules whose asserts are the tests' own: rewritten for pytest's messages like test modules.
pytest.register_assert_rewrite("chain", "otelcol", "scrapecluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow(seconds=N): takes seconds (a real process, a validator, a compile); "
                                       "run first, the longest (N, default 1) first of all")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, each group in its own order: with pytest-xdist the workers take them
    while the quick ones are still there to even out the end, instead of one worker finishing a
    long test alone. Tests that take minutes say so (`slow(seconds=...)`) and go first of all."""
    def key(item: pytest.Item) -> tuple[bool, float]:
        slow = item.get_closest_marker("slow")
        return slow is None, -(slow.kwargs.get("seconds", 1) if slow else 0)

    items.sort(key=key)
