"""From the agents' samples and the parent's to the figures: latency per window and per
minute, each agent's memory, pool, descriptors and threads, and the host's and the databases'
work per minute."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from benchmarks.soak.checks import flat
from benchmarks.soak.config import GROUPS, MIN_GROUP, STREAMS, Config
from prefect_gpu_budget.testing.stats import (
    host_and_db,
    per_minute_p95,
    percentile,
    slope_per_min,
)


def window_latency(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """p95 of a window: the median of the p95s of up to 5 consecutive groups of >= 20 samples."""
    values = [ms for _, ms in sorted(samples)]
    groups = min(GROUPS, len(values) // MIN_GROUP)
    if groups == 0:
        return {"n": len(values), "groups": 0, "p95_ms": None, "p50_ms": None}
    size = len(values) / groups
    chunks = [values[round(i * size) : round((i + 1) * size)] for i in range(groups)]
    return {
        "n": len(values),
        "groups": groups,
        "p95_ms": statistics.median(percentile(c, 95) for c in chunks),
        "p50_ms": percentile(values, 50),
        "pooled_p95_ms": percentile(values, 95),
        "max_ms": max(values),
    }


def within(t: float, window: tuple[float, float]) -> bool:
    return window[0] <= t < window[1]


def median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def analyse(
    cfg: Config,
    records: list[list[dict[str, Any]]],
    parent: list[dict[str, Any]],
    start: float,
    end: float,
) -> dict[str, Any]:
    t0 = start + cfg.warmup_s
    edge = (end - t0) * cfg.edge
    first, last, steady = (t0, t0 + edge), (end - edge, end + 1e-3), (t0, end + 1e-3)
    early = (t0, (t0 + end) / 2)  # connections may open lazily; they must not grow after
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    counts: Counter[str] = Counter()
    errors: list[str] = []
    unreleased: list[str] = []
    agents = []
    for index, lines in enumerate(records):
        for line in lines:
            for stream, pairs in line["latency"].items():
                streams[stream] += [tuple(p) for p in pairs]
        finals = [line for line in lines if line["final"]]
        if finals:
            counts.update(finals[-1]["counts"])
            errors += [f"agent {index}: {e}" for e in finals[-1]["errors"]]
            unreleased += [f"agent {index}: {u}" for u in finals[-1].get("unreleased", [])]
        agents.append(agent_figures(index, lines, (first, last, steady, early), finals))
    latency = {}
    for stream in STREAMS:
        a = window_latency([p for p in streams[stream] if within(p[0], first)])
        b = window_latency([p for p in streams[stream] if within(p[0], last)])
        ratio = b["p95_ms"] / a["p95_ms"] if a["p95_ms"] and b["p95_ms"] else None
        minutes = per_minute_p95(streams[stream], t0, end)
        latency[stream] = {"start": a, "end": b, "ratio": ratio, **minutes}
    pg = [(s["t"], s["pg"]) for s in parent]
    server = [(s["t"], s["server_mib"]) for s in parent if s["server_mib"] is not None]

    def edges(points: list[tuple[float, float]]) -> dict[str, float | None]:
        return {
            "start": median_of([v for t, v in points if within(t, first)]),
            "end": median_of([v for t, v in points if within(t, last)]),
            "early_max": max((v for t, v in points if within(t, early)), default=None),
            "max": max((v for t, v in points if within(t, steady)), default=None),
        }

    admitted = counts["admitted"]
    return {
        "windows": {
            "warmup_s": cfg.warmup_s,
            "start": [first[0] - start, first[1] - start],
            "end": [last[0] - start, last[1] - start],
        },
        "totals": {
            "submitted": counts["submitted"],
            "admitted": admitted,
            "admitted_without_wait": admitted - counts["admitted_after_wait"],
            "completed": counts["completed"],
            "withdrawn": counts["withdrawn"],
            "interrupted": counts["interrupted"],
            "timed_out": counts["timed_out"],
            "starved": counts["starved"],
            "stuck": counts["stuck"],
            "rejected": counts["rejected"],
            "prefect_limit_waits": counts["prefect_limit_waits"],
            "errors": counts["errors"],
            "admissions_per_s": admitted / cfg.run_s,
        },
        "leases_unreleased": unreleased,
        "throughput": {
            "start_per_s": sum(1 for t, _ in streams["decide"] if within(t, first)) / edge,
            "end_per_s": sum(1 for t, _ in streams["decide"] if within(t, last)) / edge,
        },
        "latency": latency,
        "agents": agents,
        "pg_backends": edges(pg),
        "prefect_server_mib": edges(server),
        "host_and_db": host_and_db(parent, t0),
        "flat": flat(agents, edges(pg)),
        "errors": errors,
    }


def agent_figures(
    index: int,
    lines: list[dict[str, Any]],
    windows: tuple[tuple[float, float], ...],
    finals: list[dict[str, Any]],
) -> dict[str, Any]:
    first, last, steady, early = windows
    samples = [line for line in lines if not line["final"]]

    def at(key: str, window: tuple[float, float]) -> float | None:
        return median_of([s[key] for s in samples if within(s["t"], window)])

    def most(key: str, window: tuple[float, float]) -> float | None:
        return max((s[key] for s in samples if within(s["t"], window)), default=None)

    for s in samples:
        s["pool"] = s["pool_idle"] + s["pool_out"]
    rss_start, rss_end = at("rss_kib", first), at("rss_kib", last)
    final = finals[-1] if finals else None
    return {
        "index": index,
        "samples": len(samples),
        "rss_start_mib": None if rss_start is None else rss_start / 1024,
        "rss_end_mib": None if rss_end is None else rss_end / 1024,
        "rss_max_mib": (most("rss_kib", steady) or 0) / 1024,
        "rss_growth_mib": None
        if rss_start is None or rss_end is None
        else (rss_end - rss_start) / 1024,
        "rss_slope_kib_per_min": slope_per_min(
            [(s["t"], s["rss_kib"]) for s in samples if within(s["t"], steady)]
        ),
        "threads": {
            "start": at("threads", first),
            "end": at("threads", last),
            "early_max": most("threads", early),
        },
        "fds": {"start": at("fds", first), "end": at("fds", last), "early_max": most("fds", early)},
        "pool": {
            "start": at("pool", first),
            "end": at("pool", last),
            "early_max": most("pool", early),
        },
        "final": None
        if final is None
        else {k: final[k] for k in ("rss_kib", "threads", "fds", "pool_idle", "pool_out")},
    }
