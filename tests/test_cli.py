"""The CLI's ledger and catalog commands, and the package itself, import neither Prefect nor
pandas, matplotlib or a cloud SDK (their speed is measured in benchmarks/cli_latency.py)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_URL
from tests.postgres import require_postgres

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
    ["agent", "grant", "acme/vision/agent-7"],
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


def test_block_register_finds_every_block() -> None:
    """`prefect block register -m prefect_gpu_budget` registers what `inspect.getmembers` finds."""
    from prefect.blocks.core import Block

    import prefect_gpu_budget

    found = {
        name for name, cls in inspect.getmembers(prefect_gpu_budget) if Block.is_block_class(cls)
    }
    assert found == {
        "CapacityPool",
        "DeploymentLauncher",
        "GpuBudget",
        "SageMakerLauncher",
        "SpendLedger",
        "VertexLauncher",
    }


def test_collection_loader_registers_the_blocks() -> None:
    """Prefect's collection loader (run by servers, workers and `Block.load` by slug) makes the
    budget blocks known by their slugs in a fresh process."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from prefect.plugins import load_prefect_collections; load_prefect_collections();"
            "from prefect.blocks.core import Block;"
            "print(Block.get_block_class_from_key('gpu-budget').__name__,"
            " Block.get_block_class_from_key('gpu-spend-ledger').__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.stdout.split() == ["GpuBudget", "SpendLedger"], done.stderr[-2000:]


_TRIAL = """
import json, os, sys, time
time.sleep(0.2)
with open(os.environ["GPU_BUDGET_METRICS_FILE"], "a") as out:
    out.write(json.dumps({"summary": True, "loss": float(sys.argv[1])}) + "\\n")
"""


def test_sweep_command_runs_a_yaml_sweep_and_prints_its_table(prefect_api, prices, tmp_path):
    (tmp_path / "trial.py").write_text(_TRIAL)
    spec = {
        "name": "cli",
        "scope": "clisweep/team/a",
        "job": {"instance_type": "local:box", "max_runtime": "30s", "kill_grace": "1s"},
        "command": [sys.executable, str(tmp_path / "trial.py"), "{lr}"],
        "grid": {"lr": [0.5, 0.25, 0.125]},
        "parallelism": 3,
        "results_dir": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(spec))  # JSON is YAML
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    subprocess.run([*cli, "budget", "set", "clisweep", "--hourly-cap", "100"], env=env, check=True)
    done = subprocess.run(
        [*cli, "sweep", str(tmp_path / "sweep.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["trial", "lr"])
    assert "state" in header and "cost_usd" in header
    rows = [line.split() for line in lines[lines.index(header) + 1 :] if line[:1] == " "]
    assert [r[0] for r in rows] == ["0", "1", "2"] and all("Completed" in r for r in rows), lines
    [results] = [line for line in lines if line.startswith("results: ")]
    assert (Path(results.split(": ", 1)[1]) / "trials.csv").is_file()

    bad = subprocess.run(
        [*cli, "sweep", str(tmp_path / "missing.yaml")], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        f"error: spec: cannot read {tmp_path / 'missing.yaml'}: No such file or directory"
    ]
