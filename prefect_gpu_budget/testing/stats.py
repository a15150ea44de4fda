"""Order statistics of latency samples, and how figures move over a long run: the p95 of each
minute and the host's and the databases' work per minute with their trends (the soak's figures,
benchmarks/soak/analysis.py; tests/test_soak.py checks them)."""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any


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


def per_minute_p95(samples: list[tuple[float, float]], t0: float, end: float) -> dict[str, Any]:
    """p95 of each whole minute after warm-up, and their least-squares trend over the run as a
    percentage of their mean: a leak climbs steadily, while a one-off step or a noisy minute
    (another tenant on the host) moves the start/end ratio but hardly the trend."""
    by_minute: dict[int, list[float]] = defaultdict(list)
    for t, ms in samples:
        if t0 <= t < end:
            by_minute[int((t - t0) // 60)].append(ms)
    whole = int((end - t0) // 60)
    points = [(60.0 * m, percentile(by_minute[m], 95)) for m in range(whole) if by_minute[m]]
    trend = trend_pct(points, whole - 1)
    return {"per_minute_p95_ms": [round(v, 1) for _, v in points], "trend_pct": trend}


def host_and_db(parent: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Each minute after warm-up: the host's CPU steal (%), and rows PostgreSQL read per
    committed transaction in the ledger's and the Prefect server's databases, with each one's
    trend (`trend_pct`). Latency that climbs while rows per transaction stay flat is not
    the queries doing more work; climbing with the steal, it is the host."""
    marks = [s for s in parent if "cpu" in s]
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a, b in itertools.pairwise(marks):
        if b["t"] <= t0:
            continue
        total = b["cpu"][1] - a["cpu"][1]
        if total > 0:
            series["steal_pct"].append((b["t"], 100 * (b["cpu"][0] - a["cpu"][0]) / total))
        for db in ("ledger", "prefect"):
            xacts = b["db"][db][0] - a["db"][db][0]
            if xacts > 0:
                series[f"{db}_rows_per_xact"].append(
                    (b["t"], (b["db"][db][1] - a["db"][db][1]) / xacts)
                )
    out = {}
    for name, points in series.items():
        trend = trend_pct(points, (points[-1][0] - points[0][0]) / 60)
        out[name] = {"per_minute": [round(v, 2) for _, v in points], "trend_pct": trend}
    return out
