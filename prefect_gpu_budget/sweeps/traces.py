"""Synthetic months of GPU jobs for the simulator (`synthetic_trace`): job sizes and runtime
errors drawn from the laws the fidelity benchmarks compare the policies on.
"""

from __future__ import annotations

import math
import random

from prefect_gpu_budget.sweeps.sim_model import SimJob

TRACE_KINDS = ("lognormal", "heavy-tail", "overrun-tail")


def _bounded_pareto(rng: random.Random, alpha: float, low: float, high: float) -> float:
    """A draw from the Pareto law of index `alpha` truncated to [low, high] (inverse CDF)."""
    tail = 1.0 - (low / high) ** alpha
    return low / (1.0 - rng.random() * tail) ** (1.0 / alpha)


def synthetic_trace(
    jobs: int = 10_000,
    seed: int = 0,
    kind: str = "lognormal",
    *,
    start: float = 1_798_761_600.0,  # 2027-01-01 00:00 UTC, a Friday
    days: float = 30.0,
    teams: int = 4,
    max_factor: float = 3.0,
) -> list[SimJob]:
    """A month of GPU jobs whose runtimes miss their estimates.

    `lognormal`: estimates are log-uniform from 10 min to 4 h; true / expected is log-normal
    with median 1 (sigma 0.25), and 10% of jobs run 1-3x their estimate. `heavy-tail`: the same
    errors, on job sizes that are heavy-tailed: estimates follow a Pareto law (alpha 1.1)
    bounded to 15 min - 24 h, so the largest 1% of jobs hold about 15% of the GPU hours (3% in
    the first trace).
    `overrun-tail`: the first trace's sizes, with errors that are heavy-tailed: true / expected
    is Pareto (alpha 1.5) scaled to a median of 1, so about 9.6% of jobs need more than 3x
    their estimate and a policy that stops jobs at max_runtime never finishes them (they take
    about 22% of what it spends). max_runtime is `max_factor` times the estimate; prices are
    catalog-like.
    """
    rng = random.Random(seed)
    rates = [1_006_000, 4_601_600, 5_672_000, 21_958_000, 27_447_000]
    out = []
    for i in range(jobs):
        arrival = start + rng.uniform(0, days * 86400)
        expected, ratio = _runtimes(rng, kind)
        team = rng.randrange(teams)
        out.append(
            SimJob(
                job_id=f"j{i:06d}",
                scope=f"org/team{team}/agent{rng.randrange(8)}",
                arrival=arrival,
                rate_micro_per_hour=rng.choice(rates) * (1 if rng.random() < 0.8 else 2),
                expected_s=expected,
                true_s=expected * ratio,
                max_runtime_s=max_factor * expected,
                priority=rng.choice((0, 0, 0, 100)),
            )
        )
    return out


def _runtimes(rng: random.Random, kind: str) -> tuple[float, float]:
    """A job's expected runtime and its true / expected ratio, as the trace `kind` draws them."""
    if kind == "heavy-tail":
        expected = _bounded_pareto(rng, 1.1, 900.0, 86400.0)
    else:
        expected = math.exp(rng.uniform(math.log(600), math.log(4 * 3600)))
    if kind in ("lognormal", "heavy-tail"):
        ratio = rng.lognormvariate(0, 0.25)
        if rng.random() < 0.10:
            ratio = rng.uniform(1.0, 3.0)
    elif kind == "overrun-tail":
        ratio = rng.paretovariate(1.5) / 2 ** (1 / 1.5)
    else:
        raise ValueError(f"kind must be one of {', '.join(TRACE_KINDS)}; got {kind!r}")
    return expected, ratio
