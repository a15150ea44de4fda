"""Issue 31, points 7 and 8: one way to price a job, and flex-start at an honest upper bound.

7. `price_job` is what the gate, `quote` and `forecast` (and so the simulator) price a job with:
   a 1-GPU part of `aws:p4d.24xlarge` is $2.74475/h in all three, never the machine's $21.958.
8. A flex-start row with no public figure is quoted at its machine's on-demand price, where that
   has one, marked as an upper bound (`Quote.bound`, a warning, the `quote` output); where the
   on-demand price has no figure either, it is refused as before: never a figure of our own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import GateEvents
from prefect_gpu_budget.admission.prices import default_catalog, price_job
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import (
    BOUND_NOTE,
    COLUMNS,
    SHIPPED,
    Catalog,
    Machines,
    read_price_file,
)
from prefect_gpu_budget.sweeps.forecast import forecast
from prefect_gpu_budget.sweeps.spec import SweepSpec
from prefect_gpu_budget.units import BudgetInputError

P4D = "aws:p4d.24xlarge"
PART_OF_P4D = 2_744_750
"""A 1-GPU part of an 8-GPU $21.958/h machine: 1/8 of it, to the micro-dollar."""
BOUNDED = {"gcp:g2-standard-4": Decimal("0.7068"), "gcp:a3-ultragpu-8g": Decimal("86.76")}
"""The shipped flex-start rows with no figure whose machine has an on-demand one."""
REFUSED = {"gcp:a2-ultragpu-1g", "gcp:a3-highgpu-8g", "gcp:a4-highgpu-8g"}
"""... and those whose machine has none either: no bound to charge, so refused."""


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shipped rows only (no user prices, no refreshed catalog), here and in the CLI."""
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "prices.csv"))
    monkeypatch.setenv("PREFECT_GPU_BUDGET_CATALOG_DIR", str(tmp_path / "catalogs"))
    default_catalog.cache_clear()
    yield tmp_path
    default_catalog.cache_clear()


def _quote(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "quote", *args],
        env={**os.environ, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _spec(scope: str, **job: object) -> SweepSpec:
    return SweepSpec(
        name="one-price",
        scope=scope,
        job={"max_runtime": "1h", "expected_runtime": "1h", **job},
        command=["true", "{i}"],
        grid={"i": [0, 1]},
        parallelism=2,
    )


def test_the_gate_quote_and_forecast_price_a_part_of_a_machine_alike(ledger, isolated):
    cli = _quote(P4D, "--gpus", "1")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"{P4D} (on-demand) x1: $2.74475/h  1/8 of each node's price")

    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = Pool("acme", "p4d", 1, (8, 96, 1152), (P4D,), "A100")
    ledger.config.set_pool(pool, [TeamQuota("p4d", "acme/ml", proportional(pool, 8))])
    gate = Gate(ledger)
    job = GpuJob(instance_type=P4D, gpus=1, max_runtime="1h", kill_grace="1s")
    assert gate.quote(job).rate_micro_per_hour == PART_OF_P4D
    admission = gate.admit(job, "acme/ml/s")  # what the gate charges
    row = ledger.views.job(admission.job_id)
    assert (row["rate_micro_per_hour"], row["node_gpus"]) == (PART_OF_P4D, 1)
    gate.holding.settle(admission, ended_at=time.time(), outcome="cancelled")

    predicted = forecast(_spec("acme/ml/s", instance_type=P4D, gpus=1), ledger)
    assert {r.job.rate_micro_per_hour for r in predicted.result.records} == {PART_OF_P4D}
    assert predicted.admitted == 2 and predicted.spend_micro == 2 * PART_OF_P4D  # 1 h each

    whole = GpuJob(instance_type=P4D, max_runtime="1h")  # a whole machine: the whole price
    assert gate.quote(whole).rate_micro_per_hour == 21_958_000
    assert price_job(Machines(P4D))[0].rate_micro_per_hour == 21_958_000


def test_flex_start_without_a_figure_is_an_upper_bound_or_refused(isolated):
    catalog = Catalog.load()
    flex = {r.key: r for r in read_price_file(SHIPPED) if r.provisioning == "flex-start"}
    assert {k for k, r in flex.items() if not r.priced} == set(BOUNDED) | REFUSED
    for key, on_demand in BOUNDED.items():
        quote = catalog.quote(key, 2, "flex-start", today=date(2025, 12, 1))
        assert quote.bound and quote.rate_micro_per_hour == 2 * int(on_demand * 1_000_000)
        assert quote.warnings[0] == f"price of {key} (flex-start) is an {BOUND_NOTE}"
        assert quote.describe().endswith("/h (upper bound)")
        row = quote.row  # the job's provisioning, the on-demand figure and its source
        assert (row.key, row.provisioning, row.usd_per_hour, row.verified) == (
            key,
            "flex-start",
            on_demand,
            False,
        )
        assert row.source.endswith("(the on-demand price: an upper bound for flex-start)")
        assert catalog.bound_of(key, "flex-start") == on_demand
    for key in REFUSED:
        with pytest.raises(BudgetInputError, match="^instance_type: no flex-start price for "):
            catalog.quote(key, provisioning="flex-start")
        assert catalog.bound_of(key, "flex-start") is None
    # a figure of its own is never a bound; nor is a bound taken for another provisioning
    a2 = catalog.quote("gcp:a2-highgpu-1g", provisioning="flex-start")
    assert not a2.bound and a2.rate_micro_per_hour == 2_020_400
    assert not any(BOUND_NOTE in w for w in a2.warnings)
    with pytest.raises(BudgetInputError, match="no spot price for aws:g5.12xlarge"):
        catalog.quote("aws:g5.12xlarge", provisioning="spot")


def test_a_recorded_flex_start_figure_replaces_the_bound(isolated):
    (isolated / "prices.csv").write_text(
        ",".join(COLUMNS)
        + "\ngcp,g2-standard-4,flex-start,L4 24GB,1,4,16,0.41,our own invoice,2026-11-01,yes\n"
    )
    quote = Catalog.load().quote("gcp:g2-standard-4", provisioning="flex-start")
    assert not quote.bound and quote.rate_micro_per_hour == 410_000
    assert quote.row.source == "our own invoice"


def test_quote_says_it_is_an_upper_bound(isolated):
    for key, on_demand in BOUNDED.items():
        done = _quote(key, "--provisioning", "flex-start", "--hours", "2")
        assert done.returncode == 0, done.stderr
        first, second, *rest = done.stdout.splitlines()
        assert first.startswith(f"{key} (flex-start) x1: ${on_demand:,}/h (upper bound)")
        assert second.startswith(f"2 h: ${2 * on_demand:,.2f}")
        assert f"warning: price of {key} (flex-start) is an {BOUND_NOTE}" in rest
    part = _quote("gcp:a3-ultragpu-8g", "--provisioning", "flex-start", "--gpus", "1")
    assert part.stdout.startswith("gcp:a3-ultragpu-8g (flex-start) x1: $10.845/h (upper bound)")
    for key in REFUSED:  # no figure to bound it with: exit 2, one line, as before
        done = _quote(key, "--provisioning", "flex-start")
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith(f"error: instance_type: no flex-start price for {key}: ")
        assert done.stderr.count("\n") == 1
    listed = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "prices", "list"],
        env={**os.environ, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    line = next(x for x in listed.splitlines() if "gcp:g2-standard-4" in x and "flex-start" in x)
    assert "no figure; at most 0.7068 (on-demand)" in line


def test_the_gate_and_forecast_charge_and_tell_the_bound(ledger, isolated):
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_budget(BudgetRule("acme/ml"))
    told: list[tuple[str, ...]] = []
    gate = Gate(ledger, events=GateEvents(admitted=lambda a: told.append(a.quote.warnings)))
    job = GpuJob(instance_type="gcp:g2-standard-4", provisioning="flex-start", max_runtime="1h")
    admission = gate.admit(job, "acme/ml/s")
    assert admission.quote.bound
    row = ledger.views.job(admission.job_id)
    assert (row["provisioning"], row["rate_micro_per_hour"]) == ("flex-start", 706_800)
    assert told and f"price of gcp:g2-standard-4 (flex-start) is an {BOUND_NOTE}" in told[0]
    gate.holding.settle(admission, ended_at=time.time(), outcome="cancelled")

    predicted = forecast(
        _spec("acme/ml/s", instance_type="gcp:g2-standard-4", provisioning="flex-start"), ledger
    )
    assert predicted.spend_micro == 2 * 706_800
    assert f"price of gcp:g2-standard-4 (flex-start) is an {BOUND_NOTE}" in predicted.warnings
    assert f"price warning: price of gcp:g2-standard-4 (flex-start) is an {BOUND_NOTE}" in (
        predicted.describe()
    )
    assert predicted.as_dict()["warnings"] == list(predicted.warnings)
