"""Benchmark: what one admission and its settlement cost in CPU, against bare Prefect's two calls.

One process, one Prefect server of its own (`prefect server start` on SQLite, as
`benchmarks/gate_latency.py` serves it), a PostgreSQL ledger of its own; uncontended, one call
at a time. Kinds, taking turns round by round so that a change in the machine's load falls on
all alike:

- bare: acquire and release one slot of one global concurrency limit under a lease (the raw
  client calls the gate makes);
- bare-path: the same two calls over two limits at once, as the gate asks them for a job under
  two capped scopes (its org and its team): what Prefect's server adds for the path;
- ledger: `Gate(ledger, None)`: `admit` + `settle` with no Prefect limits, the ledger's work
  and the gate's threads only;
- gate: `admit` + `settle` with the org's and the team's Prefect limits, as a capped scope's
  job takes them (after the scope's first job: the fast path, one commit per admission).

For each: this process's CPU per operation (`time.process_time`, every thread), the whole
machine's busy CPU per operation (`/proc/stat`: the Prefect server's and PostgreSQL's work
included, and whatever else runs), and the wall time per operation. A shared machine's other
work inflates the machine's figure alike for every kind of a round.

Usage: python -m benchmarks.gate_cpu [--ops 300] [--rounds 3] [--json]
Progress goes to stderr; the table (or, with --json, one JSON object) to stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/gate_cpu.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import postgres_database, prefect_server
from benchmarks.harness.report import logger, num, table

log = logger("gate-cpu")
KINDS = ("bare", "bare-path", "ledger", "gate")


def machine_busy_s() -> float:
    """Seconds of CPU the whole machine has spent busy (not idle, not waiting on I/O)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def measure(op: Callable[[], None], ops: int) -> dict[str, float]:
    """`op` run `ops` times: ms per op of this process's CPU, the machine's, and the wall's."""
    busy, cpu, wall = machine_busy_s(), time.process_time(), time.perf_counter()
    for _ in range(ops):
        op()
    return {
        "process_ms": (time.process_time() - cpu) * 1000 / ops,
        "machine_ms": (machine_busy_s() - busy) * 1000 / ops,
        "wall_ms": (time.perf_counter() - wall) * 1000 / ops,
    }


def operations(ledger_url: str, prices: Path, client: Any) -> dict[str, Callable[[], None]]:
    """Each kind's one operation, warmed up."""
    from uuid import UUID

    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.limits import RateLimits
    from prefect_gpu_budget.admission.rules.policy import BudgetRule
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import Catalog

    ledger = Ledger(ledger_url)
    ledger.config.set_budget(BudgetRule("cpu", hourly_cap_cents=10**9))
    ledger.config.set_budget(BudgetRule("cpu/t", hourly_cap_cents=10**9))
    catalog = Catalog.load(prices)
    job = GpuJob(instance_type="local:cpu", max_runtime="1h")
    for name in ("bare", "bare-team"):
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=10**6))

    def bare(names: list[str]) -> Callable[[], None]:
        def op() -> None:
            response = client.increment_concurrency_slots_with_lease(
                names=names, slots=1, mode="concurrency", lease_duration=60
            )
            client.release_concurrency_slots_with_lease(UUID(response.json()["lease_id"]))

        return op

    def through(gate: Gate, scope: str) -> Callable[[], None]:
        def op() -> None:
            admission = gate.admit(job, scope)
            gate.holding.settle(admission, ended_at=time.time(), outcome="completed")

        return op

    ops = {
        "bare": bare(["bare"]),
        "bare-path": bare(["bare", "bare-team"]),
        "ledger": through(Gate(ledger, None, catalog=catalog), "cpu/t/ledger"),
        "gate": through(Gate(ledger, RateLimits(client), catalog=catalog), "cpu/t/gate"),
    }
    for op in ops.values():
        for _ in range(20):
            op()
    return ops


def run(ops: int, rounds: int) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.pricing.catalog import set_local_price

    found: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    with (
        tempfile.TemporaryDirectory(prefix="gate-cpu-") as tmp,
        postgres_database("gate_cpu") as ledger_url,
        prefect_server(),
    ):
        prices = Path(tmp) / "prices.csv"
        set_local_price("cpu", "3.6", gpus=0, path=prices)
        os.environ["PREFECT_GPU_BUDGET_PRICES"] = str(prices)
        with get_client(sync_client=True) as client:
            each = operations(ledger_url, prices, client)
            for r in range(rounds):
                order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
                for kind in order:
                    found[kind].append(measure(each[kind], ops))
                    log(f"round {r + 1}: {kind} {found[kind][-1]['process_ms']:.2f} ms CPU/op")
    medians = {
        kind: {key: statistics.median(m[key] for m in runs) for key in runs[0]}
        for kind, runs in found.items()
    }
    return {"ops": ops, "rounds": rounds, "cores": os.cpu_count(), "kinds": medians}


def render(result: dict[str, Any]) -> str:
    kinds, bare = result["kinds"], result["kinds"]["bare"]
    rows = [
        [
            kind,
            num(k["process_ms"], 2),
            num(k["process_ms"] - bare["process_ms"], 2),
            num(k["machine_ms"], 2),
            num(k["machine_ms"] / bare["machine_ms"], 2) if bare["machine_ms"] else "-",
            num(k["wall_ms"], 2),
        ]
        for kind, k in kinds.items()
    ]
    header = [
        "kind",
        "process CPU ms/op",
        "over bare",
        "machine CPU ms/op",
        "machine / bare",
        "wall ms/op",
    ]
    return (
        f"{table(header, rows)}\n\n(medians of {result['rounds']} rounds of {result['ops']} ops;"
        f" {result['cores']} cores; an op is admit + settle, or acquire + release)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300, help="operations per kind and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.ops, args.rounds)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
