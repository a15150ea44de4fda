"""The gate benchmark, sliced thin: every case once with a handful of samples, one admitter, a
ledger of tens of rows, 1 s per throughput round (benchmarks/gate_latency.py), run as a subprocess with a Prefect server
of its own; alone, and with `--before` another source tree (a copy of this one's package, so
that the other process must import it from elsewhere to pass the benchmark's own check).

Asserted: the report's shape, the counts asked for, no errors in the throughput rounds, and with
`--before` both trees' figures and their ratio for every case. No timing is asserted: the suite
runs on busy machines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.postgres import database_url, require_postgres

ROOT = Path(__file__).resolve().parents[1]
PG_URL = database_url("gate_bench", "GATE_BENCH_PG_URL")
ARGS = ["--iterations", "3", "--duration", "1", "--concurrency", "1"]
ARGS += ["--small-rows", "10", "--large-rows", "30"]
CASES = 14
"""Comparison rows: the bare limit, the gate and the decision on 2 ledgers, 3 throughput paths
at 1 admitter count, 3 ledger-size figures on 2 ledgers."""


def bench(*extra: str) -> str:
    """The benchmark's stdout; fails with its stderr's tail if it does not exit 0."""
    require_postgres(PG_URL)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own server
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gate_latency", *ARGS, *extra],
        capture_output=True,
        text=True,
        timeout=380,
        env={**env, "GATE_BENCH_PG_URL": PG_URL},
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(400)
def test_one_tree_reports_every_case() -> None:
    out = json.loads(bench("--json"))
    assert out["backends"] == ["sqlite", "postgresql"]
    assert out["config"]["iterations"] == 3 and out["config"]["concurrency"] == [1]
    assert list(out["trees"]) == ["now"] and out["trees"]["now"]["path"] == str(ROOT)
    assert "before" not in out and "comparison" not in out
    assert out["bare_prefect"]["n"] == 3
    for name in out["backends"]:
        assert out["gate"][name]["n"] == out["decision"][name]["n"] == 3
        size = out["size"][name]
        assert (size["small_rows"], size["large_rows"]) == (10, 30), size
    paths = ["prefect (bare)", "gate, sqlite", "gate, postgresql"]
    assert list(out["throughput"]) == paths
    for rounds in out["throughput"].values():
        assert [(r["workers"], r["errors"]) for r in rounds] == [(1, 0)]
        assert rounds[0]["admissions"] > 0
    assert set(out["ratios"]) == {"gate_over_prefect", "decision_p50_ms", "size_growth"}


@pytest.mark.timeout(400)
def test_before_runs_every_case_under_both_trees(tmp_path: Path) -> None:
    other = tmp_path / "other"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "prefect_gpu_budget", other / "prefect_gpu_budget", ignore=ignore)

    text = bench("--before", str(other))
    assert f"Before: {other} (not a git checkout)" in text
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    start = lines.index(["Case", "Figure", "Now", "Before", "Now / before"])
    rows = lines[start + 2 : start + 2 + CASES]
    assert lines[start + 2 + CASES] == [""], "the table has more rows than cases"
    for case, _figure, now, before, ratio in rows:
        assert float(now) > 0 and float(before) > 0, (case, now, before)
        assert float(ratio) == pytest.approx(float(now) / float(before), rel=0.05, abs=0.01)


def test_before_must_hold_the_package(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gate_latency", "--before", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "no prefect_gpu_budget package" in proc.stderr
