"""Benchmark: the admission gate against bare Prefect global concurrency limits.

Measured side by side in one run, against one throwaway Prefect server (`prefect server start
--no-services` on SQLite, leases in memory, as Prefect's test harness serves):

1. bare Prefect: acquire + release one slot of a global concurrency limit (raw client API);
2. the gate: `admit` + `settle` uncontended, with Prefect limits in the loop, and the ledger's
   own decision (`Ledger.queue.request`: record the job and decide, one transaction) alone, on
   SQLite and on PostgreSQL;
3. admissions per second with 1, 4, 16 and 32 admitters in separate processes;
4. the ledger's decision latency with 10^3 and with 10^6 settled rows in the ledger.

Usage: python -m benchmarks.gate_latency [--quick] [--json] [--before CHECKOUT]
       [--iterations N] [--duration S] [--concurrency 1,4] [--small-rows N] [--large-rows N]

The cases run in a process of their own, `benchmarks/gate_cases.py` with this checkout's
package on PYTHONPATH. `--before CHECKOUT` starts a second such process with another source
tree's package (this checkout's benchmark code, the same interpreter and Prefect server) and
runs each case under both trees in turn, the first of the two alternating from case to case, so
that a change in the machine's load during the run falls on both alike; the report adds both
figures and their ratio per case. Each tree has its own ledgers (SQLite files, PostgreSQL
databases); the bare Prefect figures, the same code under either tree, show the run's noise.

PostgreSQL is expected at 127.0.0.1:5432; the benchmark uses a database of its own per tree
(`gate_bench_<id>`, `gate_bench_before_<id>`, dropped at the end), or for this checkout the one
GATE_BENCH_PG_URL names (created if missing, its gate tables dropped and recreated, never
dropped itself). It is skipped if unreachable.
Progress goes to stderr; the table (or, with --json, one JSON object) to stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/gate_latency.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import argparse
import contextlib
import dataclasses
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from benchmarks.harness import ensure_database, postgres_database, prefect_server
from benchmarks.harness.report import logger, table
from prefect_gpu_budget.testing.postgres import SERVER
from prefect_gpu_budget.testing.servers import read_line, stop_groups

ROOT = Path(__file__).resolve().parents[1]
"""This checkout: its package is the one measured as "now"."""
PG_URL = os.environ.get("GATE_BENCH_PG_URL")
"""This checkout's PostgreSQL ledger database; None: one of the run's own."""
PG_BULK_LIMIT_S = 60.0
"""Stop bulk-loading PostgreSQL past this many seconds (and say so) to bound the run."""
START_TIMEOUT_S = 180.0
CASE_TIMEOUT_S = 3600.0
"""The longest a case may take (a bulk load to 10^6 rows on a slow disk) before the run fails."""
TARGETS = {"gate_over_prefect": 1.5, "decision_ms_sqlite": 2.0, "size_growth": 1.2}


@dataclass(frozen=True)
class Config:
    iterations: int
    duration_s: float
    small_rows: int
    large_rows: int
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    warmup: int = 5

    @classmethod
    def of(cls, quick: bool) -> Config:
        if quick:
            return cls(iterations=50, duration_s=1.5, small_rows=10**3, large_rows=10**5)
        return cls(iterations=200, duration_s=3.0, small_rows=10**3, large_rows=10**6)


log = logger("bench")


# -- one process per source tree ---------------------------------------------------------------


def describe(tree: Path) -> str | None:
    """The tree's commit (`git describe --always --dirty`), or None outside a git checkout."""
    done = subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


class TreeProcess:
    """`python -m benchmarks.gate_cases` with `tree`'s package on PYTHONPATH (after `code`, a
    folder that holds only this checkout's `benchmarks`), asked for one case at a time."""

    def __init__(self, label: str, tree: Path, code: Path) -> None:
        self.label, self.tree = label, tree.resolve()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(code), str(self.tree)]),
            "GATE_BENCH_TREE": label,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gate_cases"],
            cwd=code,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its admitters with it, should it have to be killed
        )
        try:
            package = Path(self._reply("start", START_TIMEOUT_S)["ready"]["package"]).resolve()
            if not package.is_relative_to(self.tree):
                raise RuntimeError(f"{label}: the package came from {package}, not {self.tree}")
        except BaseException:
            self.close()
            raise

    def _reply(self, case: str, timeout_s: float) -> dict[str, Any]:
        line = read_line(self.proc, time.monotonic() + timeout_s)
        if not line:
            state = "said nothing in time" if self.proc.poll() is None else "ended"
            raise RuntimeError(f"{self.label} ({self.tree}), {case}: the process {state}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(
                f"{self.label} ({self.tree}), {case}: {reply['error']}\n{reply.get('trace', '')}"
            )
        return reply

    def request(self, case: str, **args: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"case": case, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply(case, CASE_TIMEOUT_S)["ok"]

    def close(self) -> None:
        """End of input: the process closes its admitters and exits; killed if it does not."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stop_groups([self.proc])


class Trees:
    """The processes of the trees under test, each case asked of every one in turn; which goes
    first alternates from case to case."""

    def __init__(self, processes: dict[str, TreeProcess]) -> None:
        self.processes = processes
        self.labels = list(processes)
        self.turn = 0

    def each(self, case: str, args: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """`case` under every tree, with that tree's `args`; the results by tree label."""
        order = self.labels if self.turn % 2 == 0 else self.labels[::-1]
        self.turn += 1
        results = {label: self.processes[label].request(case, **args[label]) for label in order}
        return {label: results[label] for label in self.labels}


# -- setup -------------------------------------------------------------------------------------


def postgres_ledgers(stack: contextlib.ExitStack, labels: list[str]) -> dict[str, str]:
    """Each tree's PostgreSQL ledger database (this checkout's `PG_URL` if set, created if
    missing; else, and for the other tree, one of the run's own); {} when the server does
    not answer."""
    urls: dict[str, str] = {}
    try:
        for label in labels:
            if label == "now" and PG_URL is not None:
                ensure_database(PG_URL)
                urls[label] = PG_URL
            else:
                prefix = "gate_bench" if label == "now" else f"gate_bench_{label}"
                urls[label] = stack.enter_context(postgres_database(prefix, PG_URL or SERVER))
    except sa.exc.SQLAlchemyError as exc:
        log(f"PostgreSQL unavailable, skipped: {str(exc).splitlines()[0]}")
        return {}
    return urls


def code_folder(tmp: Path) -> Path:
    """A folder holding only this checkout's `benchmarks` (a link): first on each tree's
    PYTHONPATH, so that the benchmark code is this one's and the package the tree's."""
    code = tmp / "code"
    code.mkdir()
    (code / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    return code


# -- run ---------------------------------------------------------------------------------------


def run(cfg: Config, before: Path | None = None) -> dict[str, Any]:
    """Every case under this checkout (and, with `before`, under that tree too, in turn)."""
    wall, load = time.perf_counter(), os.getloadavg()[0]
    trees = {"now": ROOT, **({"before": before.resolve()} if before is not None else {})}
    with (
        tempfile.TemporaryDirectory(prefix="gate-bench-") as tmp,
        prefect_server(services=False, durable_leases=False) as api_url,
        contextlib.ExitStack() as stack,
    ):
        pg = postgres_ledgers(stack, list(trees))
        ledgers = {
            label: {
                "sqlite": (
                    f"sqlite:///{tmp}/{label}-ledger.db",
                    f"sqlite:///{tmp}/{label}-size.db",
                ),
                **({"postgresql": (pg[label], pg[label])} if pg else {}),
            }
            for label in trees
        }
        log(f"Prefect server at {api_url}; a process per tree: {', '.join(trees)}")
        code = code_folder(Path(tmp))
        processes = {
            label: stack.enter_context(contextlib.closing(TreeProcess(label, tree, code)))
            for label, tree in trees.items()
        }
        found = measure(Trees(processes), cfg, ledgers)
    for result in found.values():
        result["ratios"] = ratios(result)
    out: dict[str, Any] = {
        "config": cfg.__dict__,
        "backends": list(ledgers["now"]),
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": load,
        "trees": {label: {"path": str(t), "commit": describe(t)} for label, t in trees.items()},
        **found["now"],
    }
    if before is not None:
        out["before"] = found["before"]
        out["comparison"] = comparison(found["now"], found["before"])
    out["wall_s"] = time.perf_counter() - wall
    return out


def measure(
    trees: Trees, cfg: Config, ledgers: dict[str, dict[str, tuple[str, str]]]
) -> dict[str, dict[str, Any]]:
    """The cases, each under every tree: `ledgers` holds, per tree and backend, the URL of the
    ledger for the latency and throughput cases and that of the ledger-size case."""
    labels = trees.labels
    counts = {"iterations": cfg.iterations, "warmup": cfg.warmup}
    found: dict[str, dict[str, Any]] = {label: {} for label in labels}
    names = list(ledgers["now"])

    log(f"bare limit acquire+release x{cfg.iterations}")
    for label, result in trees.each("bare", dict.fromkeys(labels, counts)).items():
        found[label]["bare_prefect"] = result
    for name in names:
        log(f"{name}: gate admit+settle and ledger decision x{cfg.iterations}")
        args = {label: {"url": ledgers[label][name][0], **counts} for label in labels}
        for label, result in trees.each("latency", args).items():
            found[label].setdefault("gate", {})[name] = result["gate"]
            found[label].setdefault("decision", {})[name] = result["decision"]

    targets = {"prefect (bare)": dict.fromkeys(labels, "prefect")}
    for name in names:
        targets[f"gate, {name}"] = {label: ledgers[label][name][0] for label in labels}
    for label in labels:
        found[label]["throughput"] = {path: [] for path in targets}
    pool = max(cfg.concurrency)
    for path, target in targets.items():
        for workers in cfg.concurrency:
            round_args = {"workers": workers, "duration_s": cfg.duration_s, "pool": pool}
            args = {label: {"target": target[label], **round_args} for label in labels}
            for label, result in trees.each("throughput", args).items():
                log(
                    f"{label}, {path}: {workers} admitters -> {result['per_s']:.1f}/s, "
                    f"max {ms(result['max_ms'])} ms, {result['errors']} errors"
                )
                found[label]["throughput"][path].append(result)
    trees.each("close_pool", dict.fromkeys(labels, {}))

    for name in names:
        log(f"{name}: ledger decision at {cfg.small_rows:,} and {cfg.large_rows:,} rows")
        size_args = {"small_rows": cfg.small_rows, "large_rows": cfg.large_rows, **counts}
        size_args["limit_s"] = PG_BULK_LIMIT_S if name == "postgresql" else None
        args = {label: {"url": ledgers[label][name][1], **size_args} for label in labels}
        for label, result in trees.each("size", args).items():
            found[label].setdefault("size", {})[name] = result
    return found


def ratios(out: dict[str, Any]) -> dict[str, Any]:
    bare = out["bare_prefect"]["p50_ms"]
    return {
        "gate_over_prefect": {k: v["p50_ms"] / bare for k, v in out["gate"].items()},
        "decision_p50_ms": {k: v["p50_ms"] for k, v in out["decision"].items()},
        "size_growth": {k: v["growth"] for k, v in out["size"].items()},
    }


def comparison(now: dict[str, Any], before: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case: its figure (found at `keys` in each tree's results) under each tree,
    and now / before."""
    rows: list[dict[str, Any]] = []

    def add(case: str, figure: str, *keys: str | int) -> None:
        a, b = now, before
        for key in keys:
            a, b = a[key], b[key]
        ratio = a / b if a is not None and b else None
        rows.append(
            {"case": case, "figure": figure, "now": a, "before": b, "now_over_before": ratio}
        )

    add("Prefect limit acquire+release (control)", "p50 ms", "bare_prefect", "p50_ms")
    for name in now["gate"]:
        add(f"Gate admit+settle ({name})", "p50 ms", "gate", name, "p50_ms")
    for name in now["decision"]:
        add(f"Ledger decision ({name})", "p50 ms", "decision", name, "p50_ms")
    for path, rounds in now["throughput"].items():
        for i, r in enumerate(rounds):
            figure = f"per s, {r['workers']} admitters"
            add(f"Throughput, {path}", figure, "throughput", path, i, "per_s")
    for name in now["size"]:
        add(f"Decision, small ledger ({name})", "p50 ms", "size", name, "small", "p50_ms")
        add(f"Decision, large ledger ({name})", "p50 ms", "size", name, "large", "p50_ms")
        add(f"Decision large / small ({name})", "ratio", "size", name, "growth")
    return rows


# -- report ------------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def verdict(value: float, target: float) -> str:
    return "ok" if value <= target else "MISSED"


def report(out: dict[str, Any]) -> str:
    cfg, trees = out["config"], out["trees"]
    sections = [
        f"Gate benchmark ({cfg['iterations']} iterations after {cfg['warmup']} warm-up, "
        f"{cfg['duration_s']} s per throughput round at "
        f"{', '.join(map(str, cfg['concurrency']))} admitters, ledgers of "
        f"{cfg['small_rows']:,} and {cfg['large_rows']:,} rows; "
        f"{out['cpus']} CPUs, 1-min load {out['load_avg_1m_at_start']:.2f} at start; "
        "Prefect server: `prefect server start --no-services` on SQLite, same machine)",
        "",
        f"This checkout: {tree_name(trees['now'])}",
    ]
    if "before" in out:
        sections += [
            f"Before: {tree_name(trees['before'])}",
            "",
            "Now against before: each case under both trees in turn, the first alternating; the",
            "bare Prefect figures run the same code under both (the run's noise). Ratio: now /",
            "before (below 1: now is faster, except per second: above 1 is faster).",
            "",
            comparison_table(out["comparison"]),
            "",
            "The tables below are this checkout's; --json has the other tree's under `before`.",
        ]
    sections += [
        "",
        "Latency, uncontended (ms)",
        "",
        latency_table(out),
        "",
        "The gate takes slots in two limits (bench, bench/team) in one request; the bare",
        "figure takes one slot in one limit.",
        "",
        "Throughput: acquire+release (bare) or admit+settle (gate) per second, all admitters",
        "together (separate processes); latency per round trip, including the one in flight",
        "at the stop.",
        "",
        throughput_table(out["throughput"]),
        "",
        "Ledger size: decision latency (ms, record + decide) against settled rows already in the ledger",
        "",
        size_table(out["size"]),
        "",
        "Targets",
        "",
        targets_table(out["ratios"]),
    ]
    notes = report_notes(out)
    if "before" in out:
        notes += [
            f"before: {n}" for n in report_notes({**out["before"], "backends": out["backends"]})
        ]
    if notes:
        sections += ["", "Notes", "", *[f"- {n}" for n in notes]]
    sections += ["", f"Total wall time {out['wall_s']:.0f} s."]
    return "\n".join(sections)


def tree_name(tree: dict[str, Any]) -> str:
    return f"{tree['path']} ({tree['commit'] or 'not a git checkout'})"


def comparison_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        [
            r["case"],
            r["figure"],
            ms(r["now"]),
            ms(r["before"]),
            "-" if r["now_over_before"] is None else f"{r['now_over_before']:.2f}",
        ]
        for r in rows
    ]
    return table(["Case", "Figure", "Now", "Before", "Now / before"], cells)


def latency_table(out: dict[str, Any]) -> str:
    bare = out["bare_prefect"]
    rows = [
        ["Prefect limit acquire+release (raw client)", "-", ms(bare["p50_ms"]), ms(bare["p95_ms"])]
    ]
    rows += [
        [
            f"Gate admit+settle (admit {ms(g['admit_p50_ms'])} + settle {ms(g['settle_p50_ms'])})",
            name,
            ms(g["p50_ms"]),
            ms(g["p95_ms"]),
        ]
        for name, g in out["gate"].items()
    ]
    rows += [
        ["Ledger decision (record + decide)", name, ms(d["p50_ms"]), ms(d["p95_ms"])]
        for name, d in out["decision"].items()
    ]
    return table(["Operation", "Ledger", "p50", "p95"], rows)


def size_table(size: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            f"{s['small_rows']:,}",
            ms(s["small"]["p50_ms"]),
            ms(s["small"]["p95_ms"]),
            f"{s['large_rows']:,}",
            ms(s["large"]["p50_ms"]),
            ms(s["large"]["p95_ms"]),
            f"{s['load_s']:.0f} s",
        ]
        for name, s in size.items()
    ]
    header = ["Ledger", "Rows (small)", "p50", "p95", "Rows (large)", "p50", "p95", "Bulk load"]
    return table(header, rows)


def report_notes(out: dict[str, Any]) -> list[str]:
    notes = [f"{k}: {s['note']}" for k, s in out["size"].items() if s["note"]]
    notes += [
        f"{k}, {r['workers']} admitters: {r['errors']} errors, first: {r['first_error']}"
        for k, rounds in out["throughput"].items()
        for r in rounds
        if r["errors"]
    ]
    if "postgresql" not in out["backends"]:
        notes.append(f"PostgreSQL skipped: {(PG_URL or SERVER).split('@')[-1]} unreachable")
    return notes


def throughput_table(throughput: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        [
            name,
            str(r["workers"]),
            f"{r['per_s']:.1f}",
            ms(r["p50_ms"]),
            ms(r["p95_ms"]),
            ms(r["max_ms"]),
            str(r["errors"]),
        ]
        for name, rounds in throughput.items()
        for r in rounds
    ]
    return table(["Path", "Admitters", "Per second", "p50 ms", "p95 ms", "max ms", "Errors"], rows)


def targets_table(r: dict[str, Any]) -> str:
    rows = [
        [
            f"Gate p50 / Prefect p50 ({k})",
            f"{v:.2f}",
            "<= 1.5",
            verdict(v, TARGETS["gate_over_prefect"]),
        ]
        for k, v in r["gate_over_prefect"].items()
    ]
    rows += [
        [
            f"Ledger decision p50 ({k})",
            f"{v:.2f} ms",
            "<= 2 ms" if k == "sqlite" else "-",
            verdict(v, TARGETS["decision_ms_sqlite"]) if k == "sqlite" else "-",
        ]
        for k, v in r["decision_p50_ms"].items()
    ]
    rows += [
        [
            f"Decision p50 large / small ledger ({k})",
            f"{v:.2f}",
            "<= 1.2",
            verdict(v, TARGETS["size_growth"]),
        ]
        for k, v in r["size_growth"].items()
    ]
    return table(["Figure", "Value", "Target", ""], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations, 10^5 rows")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--before",
        metavar="CHECKOUT",
        type=Path,
        help="Also run each case with the package of this other source tree, in turn with this "
        "one's in the same run (both figures and their ratio per case).",
    )
    parser.add_argument("--iterations", type=int, help="samples per latency case")
    parser.add_argument("--duration", type=float, help="seconds per throughput round")
    parser.add_argument("--concurrency", help="admitters per throughput round, e.g. 1,4,16,32")
    parser.add_argument("--small-rows", type=int, help="settled rows of the small ledger")
    parser.add_argument("--large-rows", type=int, help="settled rows of the large ledger")
    args = parser.parse_args()
    cfg = Config.of(args.quick)
    given = {
        "iterations": args.iterations,
        "duration_s": args.duration,
        "small_rows": args.small_rows,
        "large_rows": args.large_rows,
        "concurrency": args.concurrency and tuple(int(n) for n in args.concurrency.split(",")),
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if args.before is not None and not (args.before / "prefect_gpu_budget").is_dir():
        parser.error(f"--before: no prefect_gpu_budget package in {args.before}")
    out = run(cfg, args.before)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(report(out))


if __name__ == "__main__":
    main()
