"""The CLI's startup: its ledger and catalog commands, and the package itself, import neither
Prefect nor pandas, matplotlib or a cloud SDK (their speed is measured in
benchmarks/cli_latency.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_URL
from tests.support.postgres import require_postgres

HEAVY = ("prefect", "pandas", "matplotlib", "boto3", "google.cloud.aiplatform", "prefect_aws")

_PROBE = """
import json, sys
from prefect_gpu_budget.cli import main
args, watched = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["prefect-gpu-budget", *args]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
heavy = [m for m in watched if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""

COMMANDS = [
    ["budget", "set", "acme", "--hourly-cap", "50", "--period-budget", "500"],
    ["budget", "set", "acme/vision", "--hourly-cap", "20"],
    ["budget", "show"],
    ["budget", "show", "--json"],
    ["status", "--json"],
    ["status"],
    ["ledger", "--json", "--limit", "20"],
    ["ledger"],
    ["quote", "aws:g5.xlarge", "--hours", "2"],
    ["prices", "set-local", "box", "--usd-per-hour", "2.5"],
    ["pool", "set", "acme", "lab", "--nodes", "2", "--gpus-per-node", "8"],
    ["pool", "quota", "acme/vision", "--pool", "lab", "--gpus", "4"],
    ["capacity", "acme"],
    ["priority", "set", "acme", "urgent", "--value", "500"],
    ["priority", "list", "acme"],
    ["priority", "remove", "acme", "urgent"],
    ["prices", "list"],
    ["budget", "set", "acme/vision", "--session-template", "--hourly-cap", "5"],
    ["agent", "grant", "acme/vision/agent-7"],
    ["agent", "limits", "acme/vision", "--max-sweeps", "3"],
    ["agent", "revoke", "acme/vision/agent-7"],
    ["reconcile"],
    ["budget", "set", "acme", "--hourly-cap", "-1"],  # a refusal takes the same path
]


def _run(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(HEAVY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_ledger_commands_import_no_prefect(kind: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    if kind == "postgresql":
        require_postgres(PG_URL)
        from tests.conftest import _fresh_pg

        url = _fresh_pg()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_GPU_BUDGET_LEDGER_URL": url,
        "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "prices.csv"),
        # a configured server that reconcile must not contact when nothing needs releasing
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
    }
    for args in COMMANDS:
        found = _run(args, env)
        assert found["heavy"] == [], f"{' '.join(args)} imported {found['heavy']}"
        assert found["code"] == (2 if "-1" in args else 0), args


def test_import_of_the_package_is_light() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, prefect_gpu_budget, prefect_gpu_budget.admission.ledger;"
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(done.stdout) == [], done.stderr


def test_public_names_load_on_use() -> None:
    import prefect_gpu_budget

    assert prefect_gpu_budget.GpuJob.__name__ == "GpuJob"
    assert set(prefect_gpu_budget.__all__) <= set(dir(prefect_gpu_budget))
    with pytest.raises(AttributeError):
        prefect_gpu_budget.NoSuchThing  # noqa: B018
