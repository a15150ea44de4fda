"""`bill import` and `bill drift` as a user runs them: jobs settled on a priced machine, then
the cloud's export in its documented schema (AWS CUR 2.0 Parquet, GCP JSON Lines) imported;
drift per job; the period's spend at the bill's figure; the same export twice changes
nothing; a malformed one exits 2 with one line and changes nothing. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.billing import fixtures
from tests.support.jobs import ran_job

NOV = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()
SAGEMAKER = {"launcher": "sagemaker:lab", "instance_type": "sagemaker:ml.p4d.24xlarge"}
VERTEX = {"launcher": "vertex:lab", "instance_type": "gcp:a2-highgpu-1g"}


PEAK = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(done.returncode)\n"
)
"""Runs a command and says, as its last line on stderr, the command's own peak memory (KiB):
the test's own RUSAGE_CHILDREN holds every child it ever waited for (Prefect servers too)."""


def _cli(url: str, *args: str, peak: bool = False) -> subprocess.CompletedProcess:
    """The CLI on the ledger `url`; with `peak`, its peak memory (KiB) the last stderr line."""
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url}
    env.pop("PREFECT_API_URL", None)
    wrap = [sys.executable, "-c", PEAK] if peak else []
    return subprocess.run(
        [*wrap, sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def house(ledger_url: str) -> tuple[str, Ledger]:
    ledger = Ledger(ledger_url)
    ledger.config.set_budget(
        BudgetRule("acme", period_budget_micro=48 * 10**6, period="month"), now=NOV + 3600
    )
    yield ledger_url, ledger
    ledger.db.dispose()


def _cur_export(path: Path, job_id: str) -> Path:
    rows = fixtures.cur_rows()
    for row in rows:
        if row["resource_tags"]:
            row["resource_tags"] = {"user_gpu_budget_job": job_id}
    return fixtures.write_parquet(path, rows)


def test_an_aws_export_trues_the_ledger_up_once(house, tmp_path: Path):
    url, ledger = house
    job = ran_job(
        ledger, "acme/nlp/a7", "2026-11-03T10:00:00Z", "2026-11-03T11:20:00Z", 37.688, **SAGEMAKER
    )
    settled = ledger.views.job(job)["actual_micro"]
    assert settled == 50_250_667  # 80 minutes at $37.688/h
    export = _cur_export(tmp_path / "part-0.parquet", job)

    done = _cli(url, "bill", "import", str(export), "--provisional-hours", "0")
    assert done.returncode == 0, done.stderr
    assert "aws-cur2 2026-11: 5 lines" in done.stdout and "1 job(s) final" in done.stdout
    assert "untagged $1.41" in done.stdout and "account-level $4.10" in done.stdout
    # $37.688 + $12.563 - $5.00 (the credit): the month's spend is the bill's, over its $48
    assert "over by bill: acme spent $45.25" not in done.stdout  # under: no mark
    month = periods.bounds("month", "UTC", NOV)[0]
    assert ledger.views.period_settled("acme", month) == 45_251_000

    drift = json.loads(_cli(url, "bill", "drift", "--json").stdout)
    [entry] = drift["jobs"]
    assert entry["job_id"] == job and entry["figure"] == "final"
    assert (entry["settled_usd"], entry["billed_usd"]) == (50.250667, 45.251)
    assert entry["drift_usd"] == pytest.approx(-4.999667)
    assert drift["scopes"]["acme/nlp/a7"]["billed_usd"] == 45.251
    assert [x["billed_usd"] for x in drift["untagged"]] == [1.4084]
    assert [x["line_type"] for x in drift["account"]] == ["Tax"]

    again = _cli(url, "bill", "import", str(export), "--provisional-hours", "0")
    assert again.returncode == 0 and "unchanged since the last import" in again.stdout, again
    assert ledger.views.period_settled("acme", month) == 45_251_000
    table = _cli(url, "bill", "drift")
    assert job[:8] in table.stdout and "acme/nlp/a7" in table.stdout, table.stdout


def test_a_bill_over_a_closed_periods_budget_is_marked(house, tmp_path: Path):
    url, ledger = house
    job = ran_job(
        ledger, "acme/nlp/a7", "2026-11-03T10:00:00Z", "2026-11-03T11:00:00Z", 37.688, **SAGEMAKER
    )
    rows = fixtures.cur_rows()[:2]  # two hours' lines, no credit: $50.25 of a $48 budget
    for row in rows:
        row["resource_tags"] = {"user_gpu_budget_job": job}
    export = fixtures.write_parquet(tmp_path / "part-0.parquet", rows)
    done = _cli(url, "bill", "import", str(export), "--provisional-hours", "0")
    assert done.returncode == 0, done.stderr
    assert "over by bill: acme spent $50.25 of its $48.00 budget" in done.stdout, done.stdout
    [mark] = ledger.bills.over_by_bill()
    assert (mark.scope, mark.spent_micro) == ("acme", 50_251_000)


def test_a_gcp_export_as_json_lines(house, tmp_path: Path):
    url, ledger = house
    job = ran_job(
        ledger, "acme/vision/a8", "2026-11-03T10:00:00Z", "2026-11-03T11:00:00Z", 3.673, **VERTEX
    )
    text = fixtures.write_gcp_jsonl(tmp_path / "raw.jsonl").read_text()
    export = tmp_path / "gcp.jsonl"
    export.write_text(text.replace(fixtures.GCP_JOB, job))
    done = _cli(url, "bill", "import", str(export), "--provisional-hours", "0")
    assert done.returncode == 0, done.stderr
    assert "gcp-billing 2026-11: 3 lines" in done.stdout, done.stdout
    [entry] = json.loads(_cli(url, "bill", "drift", "acme/vision", "--json").stdout)["jobs"]
    assert entry["billed_usd"] == pytest.approx(3.52 - 1.10 + 0.41)  # cost plus its credits
    assert entry["settled_usd"] == 3.673


@pytest.mark.parametrize(
    "break_it, said",
    [
        (
            lambda rows: [
                {k: v for k, v in r.items() if k != "line_item_unblended_cost"} for r in rows
            ],
            "column line_item_unblended_cost",
        ),
        (lambda rows: [{**r, "line_item_currency_code": "EUR"} for r in rows], "row 1"),
    ],
)
def test_a_malformed_export_exits_2_in_one_line_and_changes_nothing(
    house, tmp_path: Path, break_it, said: str
):
    url, ledger = house
    job = ran_job(
        ledger, "acme/nlp/a7", "2026-11-03T10:00:00Z", "2026-11-03T11:20:00Z", 37.688, **SAGEMAKER
    )
    good = _cur_export(tmp_path / "good.parquet", job)
    assert _cli(url, "bill", "import", str(good), "--provisional-hours", "0").returncode == 0
    before = _cli(url, "bill", "drift", "--json").stdout
    rows = fixtures.cur_rows()
    for row in rows:
        if row["resource_tags"]:
            row["resource_tags"] = {"user_gpu_budget_job": job}
    bad = fixtures.write_parquet(tmp_path / "bad.parquet", break_it(rows))
    done = _cli(url, "bill", "import", str(bad), "--provisional-hours", "0")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], lines
    assert said in lines[0], lines
    assert _cli(url, "bill", "drift", "--json").stdout == before
    missing = _cli(url, "bill", "import", str(tmp_path / "nowhere.parquet"))
    assert missing.returncode == 2 and "nowhere.parquet" in missing.stderr, missing.stderr


def _nul_csv(path: Path, job: str) -> Path:
    text = fixtures.csv_text(fixtures.cur_rows()).replace(fixtures.AWS_JOB, job)
    path.write_text(text.replace("Tax", "Ta\x00x", 1))
    return path


def _long_line(path: Path, job: str) -> Path:
    rows = fixtures.cur_rows()
    rows[0]["line_item_usage_type"] = "x" * (2 << 20)
    return fixtures.write_csv(path, rows)


def _bomb(path: Path, job: str) -> Path:
    from tests.billing.test_reading import write_bomb

    return write_bomb(path, 1 << 30)


def _gcp_without_cost(path: Path, job: str) -> Path:
    rows = [{k: v for k, v in row.items() if k != "cost"} for row in fixtures.gcp_rows()]
    return fixtures.write_gcp_jsonl(path, rows)


@pytest.mark.parametrize(
    "make, said",
    [
        (_nul_csv, "row 4: a NUL byte"),
        (_long_line, "row 1: a line longer than 1048576 characters"),
        (_bomb, "decompresses past the bound of 268435456 bytes"),
        (_gcp_without_cost, "column cost: missing column"),
    ],
)
def test_a_hostile_file_exits_2_in_one_line_and_writes_nothing(
    house, tmp_path: Path, make, said: str
):
    url, ledger = house
    job = ran_job(
        ledger, "acme/nlp/a7", "2026-11-03T10:00:00Z", "2026-11-03T11:20:00Z", 37.688, **SAGEMAKER
    )
    good = _cur_export(tmp_path / "good.parquet", job)
    assert _cli(url, "bill", "import", str(good), "--provisional-hours", "0").returncode == 0
    before = _cli(url, "bill", "drift", "--json").stdout
    month = periods.bounds("month", "UTC", NOV)[0]
    spent = ledger.views.period_settled("acme", month)
    bad = make(tmp_path / "bad.csv.gz", job)
    done = _cli(url, "bill", "import", str(good), str(bad), "--provisional-hours", "0", peak=True)
    assert done.returncode == 2, (done.stdout, done.stderr)
    *lines, peak = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and said in lines[0], lines
    assert int(peak) < 600 * 1024, peak  # KiB
    assert _cli(url, "bill", "drift", "--json").stdout == before
    assert ledger.views.period_settled("acme", month) == spent


def test_forget_accept_and_what_drift_says(house, tmp_path: Path):
    url, ledger = house
    job = ran_job(
        ledger, "acme/nlp/a7", "2026-11-03T10:00:00Z", "2026-11-03T10:00:10Z", 37.688, **SAGEMAKER
    )
    rows = fixtures.cur_rows()[:4]
    rows[0]["resource_tags"] = {"user_gpu_budget_job": job}
    rows[0]["line_item_net_unblended_cost"] = 999_999_999.0  # on a 10-second job
    rows[3]["line_item_usage_type"] = None  # a Tax line as AWS writes it
    rows[3]["line_item_line_item_description"] = "Tax for product code AmazonSageMaker"
    for row in rows[:3]:
        row["line_item_line_item_description"] = None
    rows[1]["resource_tags"] = {"user_gpu_budget_job": "not-a-job"}
    rows[2]["resource_tags"] = {}
    export = fixtures.write_parquet(tmp_path / "cur.parquet", rows)
    month = periods.bounds("month", "UTC", NOV)[0]
    settled = ledger.views.period_settled("acme", month)
    done = _cli(url, "bill", "import", str(export), "--provisional-hours", "0")
    assert done.returncode == 0, done.stderr
    assert f"held: job {job} (acme/nlp/a7) billed $999,999,999.00" in done.stdout, done.stdout
    assert ledger.views.period_settled("acme", month) == settled
    table = _cli(url, "bill", "drift").stdout
    assert "held" in table and "Tax for product code AmazonSageMaker" in table, table
    accepted = _cli(url, "bill", "accept", job)
    assert accepted.returncode == 0 and "budgets moved: acme" in accepted.stdout, accepted
    assert ledger.views.period_settled("acme", month) == 999_999_999_000_000
    forgot = _cli(url, "bill", "forget", "aws-cur2", "2026-11")
    assert forgot.returncode == 0 and "forgot aws-cur2 2026-11" in forgot.stdout, forgot
    assert ledger.views.period_settled("acme", month) == settled
    again = _cli(url, "bill", "forget", "aws-cur2", "2026-11")
    assert again.returncode == 2 and "no import of it to forget" in again.stderr


def test_drift_at_80_columns_keeps_the_money_and_signs_it_first(house, tmp_path: Path):
    url, ledger = house
    job = ran_job(
        ledger,
        "acme/vision/agent-7",
        "2026-11-03T10:00:00Z",
        "2026-11-03T11:20:00Z",
        37.688,
        **SAGEMAKER,
    )
    export = _cur_export(tmp_path / "part-0.parquet", job)
    assert _cli(url, "bill", "import", str(export), "--provisional-hours", "0").returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "bill", "drift"],
        env={**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and max(map(len, lines)) <= 80, done.stdout
    cells = {cell.strip() for line in lines for cell in line.split("│")[1:-1]}
    # the money and the bill's state stay; the job's id gives way first
    assert {"$0.6281", "$50.25", "$45.25", "-$5.00", "final"} <= cells, done.stdout
    assert "$-5.00" not in done.stdout
    [note] = [line for line in lines if line.startswith("not shown at 80 columns: ")]
    assert note.split(": ")[1].split(", ") == ["job", "why not final"], done.stdout
