"""Calendar periods (day, week from Monday, month) in a time zone, as UTC epoch seconds."""

from __future__ import annotations

from datetime import datetime, timedelta
from functools import lru_cache
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from prefect_gpu_budget.units import BudgetInputError, shown

Period = Literal["day", "week", "month"]
PERIODS: tuple[str, ...] = ("day", "week", "month")


@lru_cache(maxsize=64)
def zone(name: str) -> ZoneInfo:
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise BudgetInputError(
            "timezone", f"must be an IANA time zone like 'UTC', got {shown(name)}"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise BudgetInputError("timezone", f"unknown time zone {shown(name)}") from None


def _start_local(period: str, local: datetime) -> datetime:
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return midnight
    if period == "week":
        return midnight - timedelta(days=midnight.weekday())
    if period == "month":
        return midnight.replace(day=1)
    raise BudgetInputError("period", f"must be one of day, week, month, got {shown(period)}")


def _next_local(period: str, start: datetime) -> datetime:
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    return (start.replace(day=28) + timedelta(days=4)).replace(day=1)


_last: dict[tuple[str, str], tuple[float, float]] = {}


def bounds(period: str, tz: str, t: float) -> tuple[float, float]:
    """The [start, end) of the period holding instant `t`, as UTC epoch seconds."""
    last = _last.get((period, tz))
    if last is not None and last[0] <= t < last[1]:  # most calls ask about the same period
        return last
    z = zone(tz)
    start = _start_local(period, datetime.fromtimestamp(t, z))
    end = _next_local(period, start)
    # Re-attach the zone so that DST shifts inside the period are honoured.
    found = start.replace(tzinfo=z).timestamp(), end.replace(tzinfo=z).timestamp()
    _last[(period, tz)] = found
    return found


def overlapping(period: str, tz: str, start: float, end: float) -> list[tuple[float, float]]:
    """Every period that [start, end] touches, in order (at least the one holding `start`)."""
    out = [bounds(period, tz, start)]
    while out[-1][1] < end:
        out.append(bounds(period, tz, out[-1][1]))
    return out


def split(
    amount: int, start: float, end: float, period: str, tz: str
) -> tuple[tuple[float, int], ...]:
    """Share `amount` over the periods [start, end] spans, in proportion to time in each.

    Returns (period_start, share) pairs whose shares sum exactly to `amount`: spend counts in
    the period in which it is incurred.
    """
    first = bounds(period, tz, start)
    if end <= first[1] or end <= start:  # the common case: no cache, which would only grow
        return ((first[0], amount),)
    return _split_spans(amount, start, end, period, tz)


@lru_cache(maxsize=1024)
def _split_spans(
    amount: int, start: float, end: float, period: str, tz: str
) -> tuple[tuple[float, int], ...]:
    spans = overlapping(period, tz, start, end)
    total_us = round((end - start) * 1_000_000)
    out, given, elapsed_us = [], 0, 0
    for p_start, p_end in spans:
        elapsed_us += round((min(p_end, end) - max(p_start, start)) * 1_000_000)
        cumulative = amount * min(elapsed_us, total_us) // total_us
        out.append((p_start, cumulative - given))
        given = cumulative
    out[-1] = (out[-1][0], out[-1][1] + amount - given)
    return tuple(out)


def fmt_instant(t: float, tz: str) -> str:
    return datetime.fromtimestamp(t, zone(tz)).strftime("%Y-%m-%d %H:%M ") + tz
