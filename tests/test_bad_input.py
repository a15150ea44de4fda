"""Promise 6: bad input gets a one-line error naming the field, exit code 2, and writes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.blocks import GpuBudget
from prefect_gpu_budget.cli import main
from prefect_gpu_budget.job import GpuJob, one_line
from prefect_gpu_budget.units import BudgetInputError

BLOCK_CASES = [
    ({"scope": ""}, "scope"),
    ({"scope": "Acme"}, "scope"),
    ({"scope": "acme/../etc"}, "scope"),
    ({"scope": "a/b/c/d"}, "scope"),
    ({"scope": "аcme"}, "scope"),  # Cyrillic a
    ({"scope": "acme", "hourly_cap_usd": -1}, "hourly_cap_usd"),
    ({"scope": "acme", "hourly_cap_usd": "nan"}, "hourly_cap_usd"),
    ({"scope": "acme", "period_budget_usd": float("inf")}, "period_budget_usd"),
    ({"scope": "acme", "period_budget_usd": "1e12"}, "period_budget_usd"),
    ({"scope": "acme", "period": "year"}, "period"),
    ({"scope": "acme", "timezone": "Mars/Olympus"}, "timezone"),
    ({"scope": "acme", "on_limit": "explode"}, "on_limit"),
    ({"scope": "acme", "max_wait": "-1h"}, "max_wait"),
    ({"scope": "acme", "reservation_mode": "hope"}, "reservation_mode"),
    ({"scope": "acme", "notify_block": "no-slash"}, "notify_block"),
]

JOB_CASES = [
    ({"instance_type": "aws:g5.xlarge"}, "max_runtime"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "0s"}, "max_runtime"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "forever"}, "max_runtime"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "400d"}, "max_runtime"),
    ({"instance_type": "g5.xlarge", "max_runtime": "1h"}, "instance_type"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "1h", "nodes": 0}, "nodes"),
    (
        {"instance_type": "aws:g5.xlarge", "max_runtime": "1h", "provisioning": "free"},
        "provisioning",
    ),
    (
        {"instance_type": "aws:g5.xlarge", "max_runtime": "1h", "expected_runtime": "2h"},
        "expected_runtime",
    ),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "1h", "priority": "Urgent!"}, "priority"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "1h", "command": []}, "command"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "1h", "gpus": -1}, "gpus"),
    (  # past Dynamic Workload Scheduler's 7 days, whichever runner would take it
        {"instance_type": "gcp:a3-highgpu-8g", "max_runtime": "7d1s", "provisioning": "flex-start"},
        "max_runtime",
    ),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "1:2:3:4"}, "max_runtime"),
    ({"instance_type": "aws:g5.xlarge", "max_runtime": "1-2-3"}, "max_runtime"),
]

CLI_CASES = [
    (["budget", "set", "Acme", "--hourly-cap", "5"], "scope"),
    (["budget", "set", "acme", "--hourly-cap", "-5"], "hourly_cap"),
    (["budget", "set", "acme", "--hourly-cap", "lots"], "hourly_cap"),
    (["budget", "set", "acme", "--period-budget", "nan"], "period_budget"),
    (["budget", "set", "acme", "--period-budget", "5", "--period", "decade"], "period"),
    (["budget", "set", "acme", "--period-budget", "5", "--timezone", "Nowhere/City"], "timezone"),
    (["budget", "set", "acme", "--period-budget", "5", "--max-wait", "soon"], "max_wait"),
    (["budget", "set", "fresh"], "budget"),
    (["budget", "set", "acme/x;drop table gpu_jobs", "--hourly-cap", "1"], "scope"),
    (["quote", "aws:nonexistent"], "instance_type"),
    (["quote", "aws:g5.xlarge", "--provisioning", "gratis"], "provisioning"),
    (["quote", "aws:g5.xlarge", "--hours", "-3"], "hours"),
    (["quote", "aws:g5.xlarge", "--nodes", "0"], "nodes"),
    (["quote", "aws:p5.48xlarge", "--gpus", "9"], "gpus"),
    (["quote", "aws:g5.xlarge", "--vcpu", "-1"], "vcpu"),
    (["prices", "set-local", "My Box", "--usd-per-hour", "2"], "name"),
    (["prices", "set-local", "box", "--usd-per-hour", "-2"], "usd_per_hour"),
    (["pool", "set", "acme", "Lab A", "--nodes", "2", "--gpus-per-node", "8"], "name"),
    (["pool", "set", "acme", "lab-a", "--nodes", "0", "--gpus-per-node", "8"], "nodes"),
    (["pool", "set", "acme", "lab", "--nodes", "1", "--gpus-per-node", "8", "--kind", "x"], "kind"),
    (["pool", "set", "acme", "lab", "--nodes", "1", "--gpus-per-node", "-8"], "gpus_per_node"),
    (
        [
            "pool",
            "set",
            "acme",
            "lab",
            "--nodes",
            "1",
            "--gpus-per-node",
            "8",
            "--instance-type",
            "local:priced-nowhere-x8",
        ],
        "instance_type",
    ),
    (["pool", "quota", "acme/vision", "--pool", "nope", "--gpus", "4"], "pool"),
    (["pool", "quota", "acme/../x", "--pool", "lab", "--gpus", "4"], "team"),
    (["agent", "grant", "acme/vision"], "scope"),
    (["agent", "grant", "acme/vision/Agent 7"], "scope"),
    (["agent", "grant", "acme/vision/\u0430gent"], "scope"),  # a Cyrillic look-alike
    (["capacity", "ACME"], "org"),
    (["budget", "set", "acme\n", "--hourly-cap", "5"], "scope"),
    (["agent", "grant", "acme/agents/agent-7\n"], "scope"),
    (["agent", "revoke", "acme/agents/nobody"], "acme/agents/nobody"),
    (["ledger", "--limit", "0"], "limit"),
    (["ledger", "--limit", "-3"], "limit"),
    (["prices", "set-local", "box\n", "--usd-per-hour", "2"], "name"),
    (["prices", "set-local", "box", "--usd-per-hour", "0"], "usd_per_hour"),
    (["prices", "set-local", "box", "--usd-per-hour", "2", "--gpus", "-8"], "gpus"),
    (["prices", "set-local", "box", "--usd-per-hour", "2", "--gpus", "1" + "0" * 19], "gpus"),
]


def _snapshot(ledger: Ledger) -> tuple:
    from prefect_gpu_budget.admission.ledger import agent_grants

    with ledger.db.engine.connect() as conn:
        grants = conn.execute(agent_grants.select()).all()
    return (
        tuple(r.__dict__.items() for r in ledger.config.budgets()),
        len(ledger.views.jobs()),
        ledger.config.capacity("acme"),
        grants,
    )


@pytest.mark.parametrize(("fields", "field"), BLOCK_CASES)
def test_block_rejects(fields, field):
    with pytest.raises(ValidationError) as exc:
        GpuBudget(**fields)
    message = one_line(exc.value)
    assert "\n" not in message and message.startswith(field), message


@pytest.mark.parametrize(("fields", "field"), JOB_CASES)
def test_job_rejects(fields, field):
    with pytest.raises(ValidationError) as exc:
        GpuJob(**fields)
    message = one_line(exc.value)
    assert "\n" not in message and message.startswith(field), message


@pytest.mark.parametrize(("argv", "field"), CLI_CASES)
def test_cli_rejects_with_exit_2_and_writes_nothing(argv, field, tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "prices.csv"))
    ledger = Ledger(url)
    ledger.config.set_budget(GpuBudget(scope="acme", hourly_cap_usd=10).rule())
    before = _snapshot(ledger)
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], err
    assert _snapshot(ledger) == before
    assert not (tmp_path / "prices.csv").exists()


def test_console_script_exit_code_and_no_traceback(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_gpu_budget.cli",
            "--ledger-url",
            url,
            "budget",
            "set",
            "acme",
            "--hourly-cap",
            "inf",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "error: hourly_cap: must be a finite amount (no NaN or infinity)"


def test_gate_refuses_unknown_price_before_writing(tmp_path):
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.pricing.catalog import Catalog

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.config.set_budget(GpuBudget(scope="acme", hourly_cap_usd=10).rule())
    gate = Gate(ledger, catalog=Catalog.load())
    for job, scope in [
        (GpuJob(instance_type="local:unpriced", max_runtime="1h"), "acme"),
        (GpuJob(instance_type="aws:g5.xlarge", max_runtime="1h"), "ACME/x"),
    ]:
        with pytest.raises(BudgetInputError) as exc:
            gate.admit(job, scope)
        assert "\n" not in str(exc.value)
    assert ledger.views.jobs() == []


@pytest.mark.parametrize("template", [False, True])
def test_a_cap_prefect_cannot_hold_is_refused_in_one_line(template, tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    before = (ledger.config.budgets(), ledger.config.session_templates())
    argv = ["budget", "set", "acme/vision", "--hourly-cap", "25000000"]
    argv += ["--session-template"] if template else []
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err, err
    assert err.startswith("error: hourly_cap_usd: must be at most $21,474,836.47/h"), err
    assert (ledger.config.budgets(), ledger.config.session_templates()) == before


GOOD_ROW = "local,box,on-demand,local GPU,1,0,0,3.6,priced by user,2026-01-01,yes\n"
PRICE_FILES = [
    ("gpus=-8", GOOD_ROW.replace(",1,0,0,", ",-8,0,0,").encode()),
    ("20-digit GPUs", GOOD_ROW.replace(",1,0,0,", f",{'9' * 20},0,0,").encode()),
    ("a $0 cloud price", b"aws,g5.xlarge,on-demand,A10G,1,4,16,0,mine,2026-01-01,yes\n"),
    ("a $0 local price", GOOD_ROW.replace(",3.6,", ",0,").encode()),
    ("a name with a newline", GOOD_ROW.replace("local,box,", 'local,"box\n",').encode()),
    ("bytes that are not UTF-8", GOOD_ROW.encode() + b"local,b\xff\xfe,on-demand\n"),
]


@pytest.mark.parametrize(("what", "body"), PRICE_FILES, ids=[w for w, _ in PRICE_FILES])
def test_a_bad_prices_file_is_refused_in_one_line(what, body, tmp_path, monkeypatch, capsys):
    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.pricing.catalog import COLUMNS

    prices = tmp_path / "prices.csv"
    prices.write_bytes(",".join(COLUMNS).encode() + b"\n" + body)
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    default_catalog.cache_clear()
    argv = ["prefect-gpu-budget", "quote", "aws:g5.xlarge"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        default_catalog.cache_clear()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, err
    assert "\n" not in err and err.startswith("error: prices: ") and str(prices) in err, err


def test_a_zero_price_never_overrides_a_cloud_price(tmp_path):
    from prefect_gpu_budget.pricing.catalog import set_local_price

    with pytest.raises(BudgetInputError, match="^usd_per_hour: must be above"):
        set_local_price("box", "0", path=tmp_path / "prices.csv")
    assert not (tmp_path / "prices.csv").exists()
