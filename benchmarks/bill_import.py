"""Benchmark: `bill import` of a generated month, its lines per second and its peak memory.

    .venv/bin/python -m benchmarks.bill_import                    # --lines 100000,1000000
    .venv/bin/python -m benchmarks.bill_import --lines 10000000 --before /tmp/bill-before

For each size a CUR 2.0 month (Parquet files of at most `--per-file` lines, CUR 2.0's own
column names, line ids in no order as AWS's are: mostly untagged hourly usage of EC2 instances,
a few account lines (Tax), and
three lines of each of `--jobs` SageMaker jobs marked with their `gpu-budget-job` tag: two hours
and a credit) and a GCP billing export of the same size (Parquet, BigQuery's nested fields,
Vertex AI jobs marked with their label) are generated. The jobs are real ledger jobs, settled
in a SQLite ledger made for the run. Each export is imported by the CLI, `prefect-gpu-budget
bill import FILES --json`, in a process of its own (so its peak resident memory is its own:
`os.wait4`), into a copy of that ledger; then imported again (the same month: its lines per
second, and whether the ledger's figures moved: every budget's period spend, and every job's
bill, read before and after).

With `--before DIR` (a checkout of an earlier tree, e.g. `git worktree add /tmp/bill-before
HEAD`), each import runs a second time with `PYTHONPATH=DIR` (the CLI imports that tree's
`prefect_gpu_budget`), into a copy of the same ledger, so the table shows both side by side.
`--skip-before-above N` leaves the earlier tree out of sizes past N lines (it holds every line).

Progress goes to stderr, the table (or `--json`) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if not __package__:  # run as `python benchmarks/bill_import.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks.harness.report import logger, num, table  # noqa: E402

log = logger("bill-import")
CLI = str(Path(sys.executable).parent / "prefect-gpu-budget")
MONTH = datetime(2026, 10, 1, tzinfo=timezone.utc).timestamp()
"""The generated billing period, 2026-10: closed, its usage ended long before the run."""
HOUR = 3600
SCOPE = "bench/team"
INSTANCES = 5000
"""Untagged lines are hours of this many EC2 instances (or GCE VMs), hour after hour."""
TAX_EVERY = 10_000
"""One account-level (Tax) line in this many untagged ones."""


# -- the ledger ---------------------------------------------------------------------------------


def seed_ledger(path: Path, jobs: int) -> tuple[list[str], list[str]]:
    """A SQLite ledger with a month's budget and `jobs` settled SageMaker jobs and as many
    Vertex AI jobs, each two hours in the month: their ids (aws, gcp)."""
    from prefect_gpu_budget.admission.ledger import Ledger, NewJob
    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    ledger = Ledger(f"sqlite:///{path}")
    for scope in ("bench", SCOPE):
        rule = BudgetRule(scope, period_budget_micro=10**15, period="month")
        ledger.config.set_budget(rule, now=MONTH - 86400)
    ids: dict[str, list[str]] = {"sagemaker": [], "vertex": []}
    for i in range(jobs):
        for kind, machine in (("sagemaker", "sagemaker:ml.g5.xlarge"), ("vertex", "gcp:a2")):
            start = _job_start(i)
            asked = NewJob(
                scope=SCOPE,
                name=f"{kind}-{i}",
                instance_type=machine,
                provisioning="on-demand",
                nodes=1,
                rate_micro_per_hour=3_600_000,
                rate_cents=360,
                priority=0,
                max_runtime_s=4 * HOUR,
                expected_runtime_s=None,
                holder="bench:1:1",
                launcher=f"{kind}:bench",
            )
            job_id, decision = ledger.queue.request(asked, now=start - 1)
            assert decision.verdict == "admit", decision
            ledger.settlements.mark_started(job_id, start)
            end = start + 2 * HOUR
            ledger.settlements.settle(job_id, ended_at=end, outcome="completed", now=end)
            ids[kind].append(job_id)
    ledger.db.dispose()
    return ids["sagemaker"], ids["vertex"]


def _job_start(i: int) -> float:
    return MONTH + (24 + (i * 7) % 600) * HOUR


def figures(url: str) -> dict[str, Any]:
    """What the ledger holds that an import moves: each budget's spend in the month, each
    job's bill (billed, final, held), and its bill lines (how many, what they bill), read in
    SQL (the month's lines are millions)."""
    import sqlalchemy as sa

    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.ledger.tables import bill_jobs, bill_lines

    ledger = Ledger(url)
    try:
        spend = {s: ledger.views.period_settled(s, MONTH) for s in ("bench", SCOPE)}
        with ledger.db.read() as conn:
            bills = {
                r.job_id: (r.billed_micro, bool(r.final), bool(r.held))
                for r in conn.execute(sa.select(bill_jobs))
            }
            lines = tuple(
                conn.execute(
                    sa.select(sa.func.count(), sa.func.sum(bill_lines.c.billed_micro))
                ).one()
            )
        return {"spend": spend, "bills": bills, "lines": lines}
    finally:
        ledger.db.dispose()


# -- the exports --------------------------------------------------------------------------------


def _hours(n: int, first: int) -> tuple[np.ndarray, np.ndarray]:
    """Line i's instance and hour of the month: instance after instance, hour after hour."""
    i = np.arange(first, first + n, dtype=np.int64)
    return i % INSTANCES, (i // INSTANCES) % 720


def _ts(seconds: np.ndarray, unit: str = "ms", tz: str | None = None) -> pa.Array:
    scale = 1000 if unit == "ms" else 1_000_000
    return pa.array(seconds.astype(np.int64) * scale, type=pa.timestamp(unit, tz=tz))


def _marked(jobs: list[str], n: int) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Three lines per job: (mark, usage start, hours, cost) of two hours and a credit."""
    marks = [j for j in jobs for _ in range(3)][:n]
    starts = np.array([_job_start(i) + HOUR * (k % 2) for i in range(len(jobs)) for k in range(3)])
    hours = np.array([1, 1, 2] * len(jobs))
    cost = np.array([3.5, 3.5, -0.35] * len(jobs))
    return marks, starts[:n], hours[:n], cost[:n]


def cur_chunk(first: int, n: int, jobs: list[str], marked: int) -> pa.Table:
    """Lines first..first+n of a CUR 2.0 month; the first `marked` of the month are jobs'."""
    instance, hour = _hours(n, first)
    start = MONTH + hour * HOUR
    length = np.ones(n, dtype=np.int64)
    cost = np.round(0.01 + (np.arange(first, first + n) % 997) * 0.0043, 6)
    kinds = np.where(np.arange(first, first + n) % TAX_EVERY == TAX_EVERY - 1, "Tax", "Usage")
    kinds = kinds.astype("<U16")
    resource = [f"i-{k:017x}" for k in instance]
    tags_keys, tags_vals, offsets = [], [], [0]
    take = max(0, min(n, marked - first))
    marks, m_start, m_hours, m_cost = _marked(jobs, marked)
    if take:
        start[:take], length[:take] = m_start[first : first + take], m_hours[first : first + take]
        cost[:take], kinds[:take] = m_cost[first : first + take], "Usage"
        kinds[:take][m_cost[first : first + take] < 0] = "Credit"
        resource[:take] = [f"arn:aws:sagemaker:us-east-1:1:training-job/t-{k}" for k in range(take)]
    for k in range(n):
        if k < take:
            tags_keys.append("user_gpu_budget_job")
            tags_vals.append(marks[first + k])
        offsets.append(len(tags_keys))
    ids = [f"{(first + k) * 2654435761 % 4294967296:08x}li{first + k:010d}" for k in range(n)]
    end = start + length * HOUR
    iso = np.datetime_as_string(start.astype("datetime64[s]"), unit="s")
    return pa.table(
        {
            "identity_line_item_id": pa.array(ids),
            "identity_time_interval": pa.array([f"{s}Z/{s}Z" for s in iso]),
            "bill_billing_period_start_date": _ts(np.full(n, MONTH)),
            "line_item_line_item_type": pa.array(kinds),
            "line_item_usage_start_date": _ts(start),
            "line_item_usage_end_date": _ts(end),
            "line_item_resource_id": pa.array(resource),
            "line_item_usage_type": pa.array(np.where(kinds == "Tax", "Tax", "USE1-BoxUsage:g5")),
            "line_item_product_code": pa.array(["AmazonEC2"] * n),
            "line_item_currency_code": pa.array(["USD"] * n),
            "line_item_unblended_cost": pa.array(cost),
            "line_item_net_unblended_cost": pa.array(cost),
            "resource_tags": pa.MapArray.from_arrays(
                pa.array(offsets, type=pa.int32()),
                pa.array(tags_keys, type=pa.string()),
                pa.array(tags_vals, type=pa.string()),
            ),
        }
    )


def gcp_chunk(first: int, n: int, jobs: list[str], marked: int) -> pa.Table:
    """Lines first..first+n of a GCP billing export's month (nested as BigQuery holds it)."""
    instance, hour = _hours(n, first)
    sku = (np.arange(first, first + n) // (INSTANCES * 720)).astype(np.int64)
    start = MONTH + hour * HOUR
    length = np.ones(n, dtype=np.int64)
    cost = np.round(0.01 + (np.arange(first, first + n) % 991) * 0.0041, 6)
    kinds = np.where((np.arange(first, first + n) % TAX_EVERY) == TAX_EVERY - 1, "tax", "regular")
    take = max(0, min(n, marked - first))
    marks, m_start, m_hours, m_cost = _marked(jobs, marked)
    labels: list[dict[str, str]] = []
    offsets = [0]
    if take:
        start[:take], length[:take] = m_start[first : first + take], m_hours[first : first + take]
        cost[:take] = np.abs(m_cost[first : first + take])
        kinds[:take] = "regular"
        sku[:take] = 1000 + np.arange(first, first + take)
    for k in range(n):
        if k < take:
            labels.append({"key": "gpu-budget-job", "value": marks[first + k]})
        offsets.append(len(labels))
    text = pa.string()
    label_type = pa.struct([("key", text), ("value", text)])
    credit_type = pa.struct([("name", text), ("amount", pa.float64()), ("type", text)])
    return pa.table(
        {
            "billing_account_id": pa.array(["0000AA-BBBBBB-CCCCCC"] * n),
            "invoice": pa.array([{"month": "202610"}] * n),
            "service": pa.array([{"id": "6F81-5844-456A", "description": "Compute Engine"}] * n),
            "sku": pa.array(
                [{"id": f"SKU-{s:04d}", "description": f"N1 core {s}"} for s in sku.tolist()]
            ),
            "usage_start_time": _ts(start, "us", "UTC"),
            "usage_end_time": _ts(start + length * HOUR, "us", "UTC"),
            "project": pa.array([{"id": "bench-prj"}] * n),
            "labels": pa.ListArray.from_arrays(
                pa.array(offsets, type=pa.int32()), pa.array(labels, type=label_type)
            ),
            "cost": pa.array(cost),
            "currency": pa.array(["USD"] * n),
            "cost_type": pa.array(kinds),
            "credits": pa.array([[]] * n, type=pa.list_(credit_type)),
            "export_time": _ts(np.full(n, MONTH + 40 * 86400), "us", "UTC"),
            "resource": pa.array(
                [{"name": f"vm-{k}", "global_name": None} for k in instance.tolist()]
            ),
        }
    )


def write_month(folder: Path, kind: str, lines: int, per_file: int, jobs: list[str]) -> list[Path]:
    """The month's export as Parquet files of at most `per_file` lines, written in chunks."""
    folder.mkdir(parents=True, exist_ok=True)
    make = cur_chunk if kind == "cur2" else gcp_chunk
    marked = min(3 * len(jobs), lines)
    paths, first, chunk = [], 0, 100_000
    while first < lines:
        path = folder / f"{kind}-{len(paths):05d}.snappy.parquet"
        size = min(per_file, lines - first)
        writer = None
        for at in range(first, first + size, chunk):
            part = make(at, min(chunk, first + size - at), jobs, marked)
            writer = writer or pq.ParquetWriter(path, part.schema, compression="snappy")
            writer.write_table(part)
        assert writer is not None
        writer.close()
        paths.append(path)
        first += size
    return paths


# -- the imports --------------------------------------------------------------------------------


def run_import(files: list[Path], url: str, tree: str | None) -> dict[str, Any]:
    """`bill import FILES --json` in a process of its own: seconds, peak RSS, what it said."""
    env = {
        **os.environ,
        "PREFECT_GPU_BUDGET_LEDGER_URL": url,
        "PREFECT_HOME": str(Path(url[10:]).parent),
    }
    if tree:
        env["PYTHONPATH"] = tree
    args = [CLI, "bill", "import", *map(str, files), "--json", "--max-file-mib", "4096"]
    began = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - began
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        said, errors = out.read().decode(), err.read().decode()
    if proc.returncode:
        raise RuntimeError(f"bill import exited {proc.returncode}: {errors[-2000:]}")
    done = json.loads(said[said.index("[") :])
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024, "done": done}


def measure(size: int, args: argparse.Namespace, work: Path, trees: dict[str, str | None]) -> list:
    """Each export of `size` lines imported, then again, by each tree: the table's rows."""
    seed = work / "seed.db"
    if not seed.exists():
        aws, gcp = seed_ledger(seed, args.jobs)
        seed.with_suffix(".json").write_text(json.dumps({"aws": aws, "gcp": gcp}))
    aws, gcp = _seed_ids(seed)
    rows = []
    for kind, jobs in (("cur2", aws), ("gcp", gcp)):
        began = time.perf_counter()
        files = write_month(work / f"{kind}-{size}", kind, size, args.per_file, jobs)
        log(f"{kind} {size:,} lines in {len(files)} file(s) in {time.perf_counter() - began:.0f} s")
        for tree_name, tree in trees.items():
            if tree and size > args.skip_before_above:
                continue
            db = work / f"{tree_name}-{kind}-{size}.db"
            shutil.copy(seed, db)
            url = f"sqlite:///{db}"
            first = run_import(files, url, tree)
            after_first = figures(url)
            again = run_import(files, url, tree)
            same = figures(url) == after_first
            rows.append(_row(kind, size, len(files), tree_name, first, again, same, after_first))
            log(
                f"{tree_name} {kind} {size:,}: {first['seconds']:.1f} s, {first['rss_mib']:.0f} MiB"
            )
            db.unlink()
        shutil.rmtree(work / f"{kind}-{size}")
    return rows


def _seed_ids(seed: Path) -> tuple[list[str], list[str]]:
    ids = json.loads(seed.with_suffix(".json").read_text())
    return ids["aws"], ids["gcp"]


def _row(kind, size, files, tree, first, again, same, after) -> dict[str, Any]:
    [done] = first["done"]
    return {
        "export": kind,
        "lines": size,
        "files": files,
        "tree": tree,
        "seconds": first["seconds"],
        "lines_per_s": size / first["seconds"],
        "rss_mib": first["rss_mib"],
        "again_seconds": again["seconds"],
        "again_lines_per_s": size / again["seconds"],
        "again_rss_mib": again["rss_mib"],
        "again_changed": any(d["changed"] for d in again["done"]),
        "figures_same": same,
        "jobs_final": done["jobs_final"],
        "billed_usd": sum(v[0] for v in after["bills"].values()) / 1e6,
    }


def report(rows: list[dict[str, Any]]) -> str:
    header = (
        "export",
        "lines",
        "files",
        "tree",
        "s",
        "lines/s",
        "peak RSS MiB",
        "again s",
        "again lines/s",
        "again RSS MiB",
        "again moved",
        "jobs final",
    )
    body = [
        (
            r["export"],
            f"{r['lines']:,}",
            str(r["files"]),
            r["tree"],
            num(r["seconds"]),
            f"{r['lines_per_s']:,.0f}",
            num(r["rss_mib"], 0),
            num(r["again_seconds"]),
            f"{r['again_lines_per_s']:,.0f}",
            num(r["again_rss_mib"], 0),
            "yes" if r["again_changed"] or not r["figures_same"] else "no",
            str(r["jobs_final"]),
        )
        for r in rows
    ]
    return table(header, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", default="100000,1000000", help="sizes, comma-separated")
    parser.add_argument("--per-file", type=int, default=500_000, help="lines per Parquet file")
    parser.add_argument("--jobs", type=int, default=100, help="ledger jobs of each cloud")
    parser.add_argument("--before", help="an earlier tree (a git worktree) imported beside")
    parser.add_argument("--skip-before-above", type=int, default=10**12, metavar="N")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trees: dict[str, str | None] = {"this": None}
    if args.before:
        trees["before"] = str(Path(args.before).resolve())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bill-bench-") as tmp:
        for size in (int(s) for s in args.lines.split(",")):
            rows += measure(size, args, Path(tmp), trees)
    print(json.dumps(rows, indent=2) if args.json else report(rows))


if __name__ == "__main__":
    main()
