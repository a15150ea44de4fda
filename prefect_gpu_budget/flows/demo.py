"""The demo: a real small sweep under a budget whose caps bite, on a temporary Prefect server.

Twelve trials of a tiny numpy network (4 learning rates x 3 widths) on `local:demo-gpu`, priced
so that the hourly cap lets two run at once and the day budget stops the tail. Results land in
a CSV, a plot and Prefect artifacts.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import pandas as pd
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from prefect_gpu_budget.blocks import GpuBudget, SpendLedger
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import default_catalog, set_local_price
from prefect_gpu_budget.tasks.gpu_job import run_gpu_job
from prefect_gpu_budget.units import fmt_usd

DEMO_SCOPE = "demo-lab/sweeps/agent-1"


def prepare(out: Path) -> str:
    """Price the demo GPU and set the demo budgets in a ledger inside `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
        (out / stale).unlink(missing_ok=True)
    set_local_price("demo-gpu", "12", gpus=1, path=out / "prices.csv")
    default_catalog.cache_clear()
    url = f"sqlite:///{out / 'ledger.db'}"
    ledger = SpendLedger(database_url=url).ledger()
    GpuBudget(scope="demo-lab", hourly_cap_usd=100, period_budget_usd=50, period="month").apply(
        ledger
    )
    GpuBudget(
        scope="demo-lab/sweeps/agent-1",
        hourly_cap_usd=30,
        period_budget_usd="0.12",
        period="day",
        max_wait="30s",
    ).apply(ledger)
    return url


@flow(name="gpu-budget-demo", log_prints=True)
def demo_sweep(
    out_dir: str, ledger_url: str, seconds: float = 2.5, trials: int = 12
) -> pd.DataFrame:
    logger = get_run_logger()
    out = Path(out_dir)
    grid = list(itertools.product([0.05, 0.2, 0.5, 1.0], [4, 16, 64]))[:trials]
    ledger = SpendLedger(database_url=ledger_url)
    futures = []
    for lr, width in grid:
        metrics = out / f"trial-lr{lr}-w{width}.jsonl"
        metrics.unlink(missing_ok=True)
        job = GpuJob(
            instance_type="local:demo-gpu",
            max_runtime="10s",
            kill_grace="1s",
            name=f"lr={lr} width={width}",
            command=[
                sys.executable,
                "-m",
                "prefect_gpu_budget.flows.demo_trial",
                "--lr",
                str(lr),
                "--width",
                str(width),
                "--seconds",
                str(seconds),
            ],
        )
        futures.append(
            ((lr, width, metrics), run_gpu_job.submit(job, DEMO_SCOPE, ledger, str(metrics)))
        )
    rows = []
    for (lr, width, metrics), future in futures:
        state = future.wait() or future.state
        row = {"lr": lr, "width": width, "state": state.name}
        if state.is_completed():
            result = state.result()
            row.update(
                cost_usd=result.actual_usd,
                waited_s=round(result.waited_s, 1),
                runtime_s=round(result.runtime_s, 1),
            )
        else:
            row["reason"] = (state.message or "")[:90]
        lines = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        )
        summary = next((x for x in lines if x.get("summary")), {})
        row.update(loss=summary.get("loss"), accuracy=summary.get("accuracy"))
        rows.append(row)
        logger.info("trial lr=%s width=%s: %s", lr, width, state.name)
    df = pd.DataFrame(rows)
    df.to_csv(out / "trials.csv", index=False)
    _plot(df, out / "sweep.png")
    spent = float(df.get("cost_usd", pd.Series(dtype=float)).fillna(0).sum())
    create_table_artifact(
        key="gpu-budget-demo-trials",
        table=df.fillna("").to_dict("records"),
        description="Demo sweep trials",
    )
    create_markdown_artifact(
        key="gpu-budget-demo-summary",
        markdown=f"# Demo sweep\n\n{(df['state'] == 'Completed').sum()} of {len(df)} trials ran; "
        f"spent ${spent:.4f}. Trials that waited past their max wait ended in "
        f"`AdmissionTimeout`: the day budget of {DEMO_SCOPE} stopped the tail.",
    )
    return df


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    done = df[df["state"] == "Completed"]
    for width, group in done.groupby("width"):
        ax.plot(group["lr"], group["loss"], marker="o", label=f"width {width}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final loss")
    ax.set_title("Demo sweep (trials the budget admitted)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(
    out_dir: str = "gpu-budget-demo", seconds: float = 2.5, trials: int = 12
) -> pd.DataFrame:
    out = Path(out_dir).resolve()
    url = prepare(out)
    import os

    os.environ["PREFECT_GPU_BUDGET_PRICES"] = str(out / "prices.csv")
    started = time.time()
    df = demo_sweep(str(out), url, seconds=seconds, trials=trials)
    ledger = SpendLedger(database_url=url).ledger()
    status = {s["scope"]: s for s in ledger.status()}[DEMO_SCOPE]
    print(df.to_string(index=False))
    print(
        f"\nspent {fmt_usd(status['settled_micro'])} of the {fmt_usd(status['period_budget_micro'])} "
        f"day budget of {DEMO_SCOPE} in {time.time() - started:.0f}s; "
        f"results in {out}/trials.csv and {out}/sweep.png"
    )
    return df
