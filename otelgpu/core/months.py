"""Calendar months in UTC, the billing period of a cost: FOCUS datasets give each its own bill, and
an export queue merging snapshots through an outage keeps each month's money in its own month."""

from __future__ import annotations

from datetime import datetime, timezone

NS = 1_000_000_000


def month(time_s: float) -> tuple[float, float]:
    """The UTC calendar month holding the instant `time_s`: [its first second, the next month's)."""
    moment = datetime.fromtimestamp(time_s, timezone.utc)
    first = datetime(moment.year, moment.month, 1, tzinfo=timezone.utc)
    after = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=timezone.utc)
    return first.timestamp(), after.timestamp()


def month_ending(end_ns: int) -> float:
    """The first second of the calendar month that data time ending at `end_ns` (exclusive) ends in."""
    return month((end_ns - 1) // NS)[0]


def one_month(from_ns: int, end_ns: int) -> bool:
    """Whether the data time [from_ns, end_ns) lies in one calendar month."""
    return month(from_ns // NS)[0] == month_ending(end_ns)
