"""The CPU benchmark, sliced thin (benchmarks/gate_cpu.py): one round of three operations of each
kind, as a subprocess with a Prefect server and a PostgreSQL ledger of its own. Asserted: every
kind measured, each figure a reading, and the table rendered from them; no figure is
compared with a target (the suite runs on busy machines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gate_cpu import KINDS, render
from prefect_gpu_budget.testing.postgres import SERVER
from tests.support.postgres import require_postgres

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_each_kind_is_measured_and_tabled() -> None:
    require_postgres(f"{SERVER}/postgres")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own server
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gate_cpu", "--ops", "3", "--rounds", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout)
    assert (out["ops"], out["rounds"]) == (3, 1)
    assert tuple(out["kinds"]) == KINDS
    for kind, figures in out["kinds"].items():
        assert set(figures) == {"process_ms", "machine_ms", "wall_ms"}, kind
        # the machine's figure counts in ticks of 10 ms: three quick operations may see none
        assert figures["process_ms"] > 0 and figures["wall_ms"] > 0, (kind, figures)
        assert figures["machine_ms"] >= 0, (kind, figures)
    table = render(out)
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:6]] == list(KINDS)
