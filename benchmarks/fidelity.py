"""Budget fidelity: estimate-only admission against our guaranteed and estimate-metered modes.

Every policy runs on the same synthetic month of jobs through `prefect_gpu_budget.sweeps.simulator`,
which drives the gate's own decision function. For each (trace, policy): worst overshoot of any
period budget (%), budget utilisation (% of the org's monthly budget spent on jobs that
finished), budget spent (% of it spent on any job: the rest of it went to jobs stopped at
max_runtime or still running at the month's end, or was left idle), mean and p95 queue wait, and
jobs completed.

Usage: python -m benchmarks.fidelity [--jobs N] [--seed S] [--json] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/fidelity.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import time

from benchmarks.harness import report
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.sweeps.simulator import POLICIES, SimResult, simulate
from prefect_gpu_budget.sweeps.traces import TRACE_KINDS, synthetic_trace

START = 1_798_761_600.0  # 2027-01-01 00:00 UTC
TRACES = TRACE_KINDS


def budgets(jobs: int) -> list[BudgetRule]:
    """An org over-asked about 1.5x in a month (backlogged): monthly org, weekly team budgets."""
    scale = jobs / 10_000
    return [
        BudgetRule(
            "org",
            hourly_cap_cents=round(25_000 * scale),
            period_budget_micro=round(120_000e6 * scale),
            period="month",
        ),
        *(
            BudgetRule(f"org/team{t}", period_budget_micro=round(8_000e6 * scale), period="week")
            for t in range(4)
        ),
    ]


def row(trace: str, result: SimResult, seconds: float) -> dict:
    waits = result.waits()
    return {
        "trace": trace,
        "policy": result.policy.name,
        "overshoot_pct": result.overshoot_pct(),
        "utilization_pct": result.utilization_pct("org"),
        "spent_pct": result.spent_pct("org"),
        "wait_mean_s": round(statistics.fmean(waits), 1) if waits else 0.0,
        "wait_p95_s": round(waits[int(0.95 * (len(waits) - 1))], 1) if waits else 0.0,
        "completed": result.completed(),
        "sim_seconds": round(seconds, 2),
    }


def run(jobs: int, seed: int) -> list[dict]:
    rules = budgets(jobs)
    out = []
    for trace in TRACES:
        trace_jobs = synthetic_trace(jobs, seed=seed, kind=trace)
        for policy in POLICIES:
            started = time.perf_counter()
            result = simulate(trace_jobs, rules, policy, until=START + 31 * 86400)
            out.append(row(trace, result, time.perf_counter() - started))
    return out


def table(rows: list[dict]) -> str:
    header = ["trace", "policy", "overshoot %", "utilisation %", "spent %", "wait mean h"]
    header += ["wait p95 h", "completed", "sim s"]
    cells = [
        [
            r["trace"],
            r["policy"],
            f"{r['overshoot_pct']:.2f}",
            f"{r['utilization_pct']:.2f}",
            f"{r['spent_pct']:.2f}",
            f"{r['wait_mean_s'] / 3600:.1f}",
            f"{r['wait_p95_s'] / 3600:.1f}",
            str(r["completed"]),
            f"{r['sim_seconds']:.1f}",
        ]
        for r in rows
    ]
    return report.table(header, cells)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    policies = list(POLICIES)
    width = 0.8 / len(TRACES)
    for i, trace in enumerate(TRACES):
        by_policy = {r["policy"]: r for r in rows if r["trace"] == trace}
        xs = [p + i * width for p in range(len(policies))]
        for ax, key in zip(axes, ("overshoot_pct", "utilization_pct"), strict=True):
            ax.bar(xs, [by_policy[p][key] for p in policies], width, label=trace, color=f"C{i}")
        spent = [by_policy[p]["spent_pct"] for p in policies]  # outlined: spent on any job
        axes[1].bar(xs, spent, width, fill=False, edgecolor="0.3", linestyle="--", linewidth=0.8)
    for ax, title in zip(
        axes,
        (
            "worst overshoot of a period budget (%)",
            "budget on finished jobs (%); dashed: on any job",
        ),
        strict=True,
    ):
        ax.set_xticks([p + width / 2 for p in range(len(policies))], policies)
        ax.set_title(title)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default="fidelity-out", help="Folder for the plot.")
    args = parser.parse_args()
    rows = run(args.jobs, args.seed)
    if args.json:
        print(
            json.dumps([{k: v for k, v in r.items() if k != "sim_seconds"} for r in rows], indent=2)
        )
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "fidelity.png")
    print(f"{args.jobs} jobs over a month, seed {args.seed}\n")
    print(table(rows))
    print(f"\nplot: {out / 'fidelity.png'}")


if __name__ == "__main__":
    main()
