"""Benchmark: admissions per second and gate latency with 1, 2 and 4 hosts, against bare Prefect
on the same multi-replica server.

The set-up is the multi-host tests' (tests/hosts/cluster.py): Prefect's documented multi-replica
server (two API replicas `prefect server start --no-services`, one `prefect server services
start`, Redis for messaging, ordering, Docket and leases, PostgreSQL for Prefect), a PostgreSQL
ledger, and hosts that are network and UTS namespaces of this machine (as root; otherwise process
groups on loopback, and the report says so). Each host runs `--per-host` admitter processes, each
pointed at one replica or the other (PREFECT_API_URL), and each runs one loop for the round's
duration, side by side in one run:

- bare: acquire and release one slot of one global concurrency limit, under a lease (the raw
  client calls the gate makes: `increment_concurrency_slots_with_lease` and
  `release_concurrency_slots_with_lease`), no ledger;
- gate: `Gate.admit` + `holding.settle` of a job in a session of its own under one org whose
  caps never bind (the ledger's decision is serialised per org, on PostgreSQL with an advisory
  lock, and the slots are taken under the org's and the team's limits).

With `--before DIR` (a checkout of an earlier tree, e.g. a `git worktree` of the commit before a
change), a third kind runs beside them: the gate of that tree (`before`), in admitter processes
of their own whose `prefect_gpu_budget` is imported from DIR (this file's loop and counters
drive both).

Rounds go hosts 1, 2, 4, the kinds taking turns at going first, so that a change in the
machine's load falls on all alike. The table gives, per host count, each kind's admissions
per second and p50 / p95 of one admission's round trip (admit + settle, or acquire + release),
and the gate's ratios to bare Prefect. A second table counts (on SQLAlchemy's events, not by
time: `benchmarks/harness/commits.py`) what each admission and its settlement cost the ledger:
write transactions committed, the org's lock taken (PostgreSQL's advisory lock) and the
statements sent (each a round trip to PostgreSQL) and those sent under the org's lock, per
admission, for the gate and, with
--before, the tree before.

Usage: python -m benchmarks.hosts [--hosts 1,2,4] [--per-host 2] [--duration 8] [--before DIR]
       [--json]
Run as root for hosts apart. PostgreSQL is a cluster of the run's own (`initdb`, PostgreSQL's
server programs installed), holding Prefect's database and the ledger, listening on loopback and
on the hosts' gateway: the hosts reach the ledger as they reach the replicas, with no relay in
between, and the gate and bare Prefect meet the same PostgreSQL. It is removed at the end.
Progress goes to stderr; the table (or, with --json, one JSON object) to stdout. The whole run
takes two to four minutes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/hosts.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
if "--admitter" in sys.argv[:-1]:  # an admitter of another tree: its package, before any import
    _tree = json.loads(sys.argv[sys.argv.index("--admitter") + 1]).get("tree")
    if _tree:
        sys.path.insert(0, _tree)

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import argparse
import contextlib
import subprocess
import tempfile
import threading
import time
from typing import Any

from benchmarks.harness.report import logger, num, table
from prefect_gpu_budget.testing.stats import percentile

log = logger("hosts")

ORG = "hostbench"
CAP_CENTS = 10**9
"""A cap that never binds (a Prefect limit holds at most 2,147,483,647 on PostgreSQL)."""
INSTANCE = "local:hosts"
ARM_S = 240.0
"""How long admitters may take to import, connect and warm up (a loaded 2-core machine)."""


# -- the admitter, run inside a host -----------------------------------------------------------


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def admitter(config: dict[str, Any]) -> None:
    """One admitter process: `ready` once connected; then, per line of stdin (`kind`,
    `start_at`, `stop_at`), one warm-up call, `armed`, and the loop from `start_at` to
    `stop_at`, answered with its count and latencies, and what the calls of the loop cost the
    ledger (`LedgerCounts`, over every call it made, `calls`). With `tree`, the package is that
    tree's."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    import prefect_gpu_budget
    from benchmarks.harness.commits import LedgerCounts
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.limits import RateLimits
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import Catalog

    ledger = Ledger(config["ledger_url"], create=False)
    counts = LedgerCounts(ledger.db.engine)
    with get_client(sync_client=True) as client:
        gate = Gate(ledger, RateLimits(client), catalog=Catalog.load(Path(config["prices"])))
        job = GpuJob(instance_type=INSTANCE, max_runtime="1h")

        def bare() -> None:
            response = client.increment_concurrency_slots_with_lease(
                names=[config["bare_limit"]], slots=1, mode="concurrency", lease_duration=60
            )
            client.release_concurrency_slots_with_lease(UUID(response.json()["lease_id"]))

        def through_gate() -> None:
            admission = gate.admit(job, config["scope"])
            gate.holding.settle(admission, ended_at=time.time(), outcome="completed")

        ops = {"bare": bare, "gate": through_gate, "before": through_gate}
        _say(ready=True, api=str(client.api_url), package=prefect_gpu_budget.__file__)
        for line in sys.stdin:
            command = json.loads(line)
            op = ops[command["kind"]]
            op()
            _say(armed=True)
            time.sleep(max(0.0, command["start_at"] - time.time()))
            count, calls, errors, first_error, latencies = 0, 0, 0, None, []
            before = counts.snapshot()
            while time.time() < command["stop_at"]:
                began = time.perf_counter()
                try:
                    op()
                except Exception as exc:
                    errors += 1
                    first_error = first_error or f"{type(exc).__name__}: {exc}"[:300]
                    continue
                calls += 1
                latencies.append(time.perf_counter() - began)
                if time.time() <= command["stop_at"]:
                    count += 1
            after = counts.snapshot()
            _say(
                count=count,
                errors=errors,
                first_error=first_error,
                latencies=latencies,
                calls=calls,
                **{k: after[k] - before[k] for k in after},
            )
    ledger.db.dispose()


# -- the driver --------------------------------------------------------------------------------


class Admitter:
    """An admitter process on a host, its replies read a line at a time."""

    def __init__(self, proc: subprocess.Popen, host: str) -> None:
        self.proc = proc
        self.host = host
        self.replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(ValueError), self._cond:
                self.replies.append(json.loads(raw))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def next(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.replies:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"an admitter on {self.host} ended or stayed silent")
                self._cond.wait(1.0)
            return self.replies.pop(0)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()


def one_round(admitters: list[Admitter], kind: str, duration_s: float) -> dict[str, Any]:
    """`kind` on every admitter at once for `duration_s`; admissions per second and latency."""
    start_at = time.time() + 2.0
    for a in admitters:
        a.send(kind=kind, start_at=start_at, stop_at=start_at + duration_s)
    for a in admitters:
        a.next(ARM_S)  # armed
    done = [a.next(duration_s + ARM_S) for a in admitters]
    latencies = [s for d in done for s in d["latencies"]]
    total = sum(d["count"] for d in done)
    calls = sum(d["calls"] for d in done)
    return {
        "calls": calls,
        "commits_per": sum(d["commits"] for d in done) / calls if calls else None,
        "org_locks_per": sum(d["org_locks"] for d in done) / calls if calls else None,
        "statements_per": sum(d["statements"] for d in done) / calls if calls else None,
        "under_lock_per": sum(d["under_lock"] for d in done) / calls if calls else None,
        "kind": kind,
        "admitters": len(admitters),
        "admissions": total,
        "per_s": total / duration_s,
        "p50_ms": percentile(latencies, 50) * 1000 if latencies else None,
        "p95_ms": percentile(latencies, 95) * 1000 if latencies else None,
        "errors": sum(d["errors"] for d in done),
        "first_error": next((d["first_error"] for d in done if d["first_error"]), None),
    }


def _load() -> float:
    return os.getloadavg()[0]


def run(
    hosts: list[int], per_host: int, duration_s: float, before: str | None = None
) -> dict[str, Any]:
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.limits import limit_name
    from prefect_gpu_budget.admission.rules.policy import BudgetRule
    from prefect_gpu_budget.pricing.catalog import set_local_price
    from tests.hosts.cluster import _http, cluster

    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hosts-bench-")))
        log(f"starting PostgreSQL, Redis, two replicas, the services and {max(hosts)} hosts")
        up = stack.enter_context(cluster(root, hosts=max(hosts)))
        ledger_url = up.ledger_url
        apart = up.network.why_not is None
        log("hosts: " + ("namespaces apart" if apart else f"loopback ({up.network.why_not})"))
        ledger = Ledger(ledger_url)
        ledger.config.set_budget(BudgetRule(ORG, hourly_cap_cents=CAP_CENTS))
        ledger.config.set_budget(BudgetRule(f"{ORG}/t", hourly_cap_cents=CAP_CENTS))
        ledger.db.dispose()
        prices = root / "prices.csv"
        set_local_price("hosts", "3.6", gpus=0, path=prices)
        bare_limit = limit_name(f"{ORG}-bare")
        _http(f"{up.apis[0]}/v2/concurrency_limits/", {"name": bare_limit, "limit": CAP_CENTS})

        sets: dict[str, list[Admitter]] = {"gate": []}
        if before:
            sets["before"] = []
        for tree, admitters in sets.items():
            for h, host in enumerate(up.hosts):
                for i in range(per_host):
                    config = {
                        "ledger_url": up.host_ledger_url,
                        "prices": str(prices),
                        "scope": f"{ORG}/t/{tree[0]}{h}-{i}",
                        "bare_limit": bare_limit,
                        "tree": before if tree == "before" else None,
                    }
                    argv = [sys.executable, "-m", "benchmarks.hosts"]
                    proc = host.start(
                        [*argv, "--admitter", json.dumps(config)],
                        up.host_env(
                            host, up.apis[(h + i) % 2], PREFECT_GPU_BUDGET_PRICES=str(prices)
                        ),
                        root / f"admitter-{tree}-{h}-{i}.log",
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    admitters.append(Admitter(proc, host.name))
        packages = {}
        for tree, admitters in sets.items():
            for a in admitters:
                packages[tree] = str(Path(a.next(ARM_S)["package"]).parents[1])  # ready
        if before and Path(packages["before"]).resolve() != Path(before).resolve():
            raise SystemExit(f"the tree before imported {packages['before']}, not {before}")
        log(f"{sum(map(len, sets.values()))} admitters ready on {len(up.hosts)} hosts: {packages}")

        rounds = []
        order = list(sets) + ["bare"]
        for turn, count in enumerate(hosts):
            kinds = order[turn % len(order) :] + order[: turn % len(order)]
            for kind in kinds:
                chosen = sets["before" if kind == "before" else "gate"][: count * per_host]
                load = _load()
                result = one_round(chosen, kind, duration_s)
                result.update(hosts=count, load=load)
                log(
                    f"{count} host(s), {kind}: {result['per_s']:.1f}/s, p50 "
                    f"{num(result['p50_ms'])} ms, {result['errors']} errors"
                )
                rounds.append(result)
        for a in (a for admitters in sets.values() for a in admitters):
            with contextlib.suppress(OSError):
                a.proc.stdin.close()  # type: ignore[union-attr]
        slots = {api: up.active_slots(f"{ORG}", api) for api in up.apis}
    return {
        "date": time.strftime("%Y-%m-%d"),
        "apart": apart,
        "why_not": None if apart else up.network.why_not,
        "per_host": per_host,
        "duration_s": duration_s,
        "cores": os.cpu_count(),
        "packages": packages,
        "rounds": rounds,
        "slots_left": slots,
        "wall_s": time.monotonic() - began,
    }


def report(result: dict[str, Any]) -> str:
    by = {(r["hosts"], r["kind"]): r for r in result["rounds"]}
    gates = [k for k in ("gate", "before") if any(r["kind"] == k for r in result["rounds"])]
    rows, counted = [], []
    for count in sorted({r["hosts"] for r in result["rounds"]}):
        bare = by[(count, "bare")]
        row = [str(count), str(bare["admitters"]), num(bare["per_s"])]
        for kind in gates:
            gate = by[(count, kind)]
            row += [
                num(gate["per_s"]),
                num(gate["per_s"] / bare["per_s"], 2) if bare["per_s"] else "-",
            ]
        row.append(num(bare["p50_ms"]))
        for kind in gates:
            gate = by[(count, kind)]
            ratio = gate["p50_ms"] / bare["p50_ms"] if gate["p50_ms"] and bare["p50_ms"] else None
            row += [num(gate["p50_ms"]), num(ratio, 2) if ratio else "-"]
        row += [
            " / ".join(num(by[(count, k)]["p95_ms"]) for k in ["bare", *gates]),
            " / ".join(str(by[(count, k)]["errors"]) for k in ["bare", *gates]),
            " / ".join(num(by[(count, k)]["load"], 1) for k in ["bare", *gates]),
        ]
        rows.append(row)
        for kind in gates:
            gate = by[(count, kind)]
            counted.append(
                [
                    str(count),
                    kind,
                    str(gate["calls"]),
                    num(gate["commits_per"], 2),
                    num(gate["org_locks_per"], 2),
                    num(gate["statements_per"], 2),
                    num(gate["under_lock_per"], 2),
                ]
            )
    header = ["hosts", "admitters", "bare /s"]
    for kind in gates:
        header += [f"{kind} /s", f"{kind} / bare"]
    header.append("bare p50 ms")
    for kind in gates:
        header += [f"{kind} p50 ms", f"p50 {kind} / bare"]
    kinds = " / ".join(["bare", *gates])
    header += [f"p95 ms {kinds}", "errors", "load at start"]
    where = (
        "hosts apart (network and UTS namespaces)"
        if result["apart"]
        else f"hosts on loopback: {result['why_not']}"
    )
    counts = table(
        [
            "hosts",
            "tree",
            "admissions counted",
            "ledger commits / admission",
            "org locks / admission",
            "statements / admission",
            "under the org's lock",
        ],
        counted,
    )
    return (
        f"{table(header, rows)}\n\n{counts}\n\n(admit + settle; commits: write transactions;"
        " org locks: PostgreSQL's advisory lock of the org; statements: every one the ledger"
        " sent, each a round trip; under the org's lock: those sent while it was held, its own"
        " included)\n\n"
        f"{where}; {result['duration_s']:g} s per round, "
        f"{result['cores']} cores; packages: {result.get('packages')}; slots left on the org's "
        f"limit: {result['slots_left']}; {result['wall_s']:.0f} s in all"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,2,4", help="host counts, in order")
    parser.add_argument("--per-host", type=int, default=2, help="admitter processes per host")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per round")
    parser.add_argument(
        "--before", help="an earlier tree (a git worktree) whose gate runs beside this one's"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--admitter", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.admitter:
        admitter(json.loads(args.admitter))
        return 0
    before = str(Path(args.before).resolve()) if args.before else None
    result = run([int(h) for h in args.hosts.split(",")], args.per_host, args.duration, before)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
