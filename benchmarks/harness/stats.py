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
