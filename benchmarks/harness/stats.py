"""Order statistics of latency samples."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50)


def p95(samples: Sequence[float]) -> float:
    return percentile(samples, 95)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p95 and mean in milliseconds of samples in seconds, and their count."""
    ms = [s * 1000 for s in seconds]
    return {"p50_ms": median(ms), "p95_ms": p95(ms), "mean_ms": statistics.fmean(ms), "n": len(ms)}


def slope_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t seconds, value) in value per minute; None under 3 points or
    when they share one instant."""
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def trend_pct(points: Sequence[tuple[float, float]], minutes: float) -> float | None:
    """The least-squares change over `minutes`, as a percentage of the points' mean."""
    slope = slope_per_min(points)
    if slope is None:
        return None
    mean = statistics.fmean(v for _, v in points)
    return 100 * slope * minutes / mean if mean else None
