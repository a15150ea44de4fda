"""Every table of the CLI fits the terminal: descriptions give way first, scopes, ids and money
are never cut, and columns that cannot fit are left out, the least important first, with a line
that names them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.cli.tables import TEXT_LEAST, Col, layout
from tests.support.jobs import new_job

SCOPES = ("acme", "acme/vision", "acme/vision/agent-7")


@pytest.fixture(scope="module")
def ledger_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[str]]:
    """A ledger with three nested budgets, a pool, and a running, a queued, an admitted and a
    settled job; the environment that points the CLI at it, and the jobs' ids."""
    tmp = tmp_path_factory.mktemp("tables")
    url = f"sqlite:///{tmp / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url}
    env.pop("PREFECT_API_URL", None)
    for args in (
        ("budget", "set", "acme", "--hourly-cap", "100", "--period-budget", "2000"),
        ("budget", "set", "acme/vision", "--hourly-cap", "60", "--period-budget", "500"),
        ("budget", "set", "acme/vision/agent-7", "--hourly-cap", "4", "--period-budget", "40"),
        ("pool", "set", "acme", "lab", "--nodes", "2", "--gpus-per-node", "8"),
        ("pool", "quota", "acme/vision", "--pool", "lab", "--gpus", "4"),
    ):
        done = _cli(env, 200, *args)
        assert done.returncode == 0, done.stderr
    ledger = Ledger(url)
    agent = "acme/vision/agent-7"
    ids = []
    running, _ = ledger.queue.request(
        new_job(agent, name="lr-width/0003", instance_type="aws:p4d.24xlarge", nodes=2)
    )
    assert ledger.settlements.mark_started(running, time.time())
    ids.append(running)
    queued, waits = ledger.queue.request(new_job(agent, name="nightly"))
    assert waits.verdict == "wait"
    ids.append(queued)
    admitted, admits = ledger.queue.request(new_job("acme/vision", name="eval"))
    assert admits.verdict == "admit"
    ids.append(admitted)
    done, _ = ledger.queue.request(new_job("acme", name="warmup"))
    assert ledger.settlements.mark_started(done, time.time())
    ledger.settlements.settle(
        done, ended_at=time.time(), outcome="completed", actual_micro=1_234_567_890
    )
    ids.append(done)
    ledger.db.dispose()
    return env, ids


def _cli(env: dict[str, str], width: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env={**env, "COLUMNS": str(width)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _shown(env: dict[str, str], width: int, *args: str) -> list[str]:
    done = _cli(env, width, *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines and all(len(line) <= width for line in lines), "\n".join(lines)
    assert "…" not in done.stdout, done.stdout  # nothing is cut
    return lines


def _cells(lines: list[str]) -> list[str]:
    """The table's cells, line by line (a wrapped cell's parts are separate)."""
    return [cell.strip() for line in lines for cell in line.split("│")[1:-1]]


WIDTHS = (60, 80, 120)


@pytest.mark.parametrize("width", WIDTHS)
def test_status_shows_whole_scopes_and_money(ledger_env, width: int) -> None:
    env, _ = ledger_env
    cells = _cells(_shown(env, width, "status"))
    assert set(SCOPES) <= set(cells), cells
    words = {word for cell in cells for word in cell.split()}  # a pair may wrap at its ` / `
    for rate_cap in ("$7.20 / $100.00", "$7.20 / $60.00", "$3.60 / $4.00"):
        assert rate_cap in cells or set(rate_cap.split()) <= words, cells


def _left_out(lines: list[str], width: int) -> str:
    """The names of the columns a table left out (its `not shown` note, wrapped or not)."""
    text = " ".join(lines)
    head = f"not shown at {width} columns: "
    return text[text.index(head) + len(head) :] if head in text else ""


@pytest.mark.parametrize("width", (80, 100))
def test_status_keeps_the_money_before_the_counts(ledger_env, width: int) -> None:
    env, _ = ledger_env
    lines = _shown(env, width, "status")
    cells = _cells(lines)
    left_out = _left_out(lines, width).split(", ")
    for kept in ("rate / cap", "settled", "reserved", "remaining / budget"):
        assert kept not in left_out, lines
    # acme's settled $1,234.57, what is left of its budget and the budget itself; a figure
    # pair wraps at its ` / `, never inside a figure
    assert "$1,234.57" in cells and "$2,000.00" in cells, cells
    assert {"$500.00", "$40.00"} <= set(cells), cells
    # the job admitted and not started yet is said, and what that means
    assert "(+1 starting)" in " ".join(cells) or "starting)" in cells, cells
    assert any(line.startswith("starting: admitted and not started yet") for line in lines)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_ledger_shows_whole_scopes_ids_and_money(ledger_env, width: int) -> None:
    env, ids = ledger_env
    lines = _shown(env, width, "ledger")
    cells = _cells(lines)
    assert {"acme", "acme/vision", "acme/vision/agent-7"} <= set(cells), cells
    assert "$1,234.57" in cells, cells  # the settled job's actual spend
    for kept in ("reserved", "actual", "state"):
        assert kept not in _left_out(lines, width).split(", "), lines
    if width >= 80:  # narrower, the ids give way before the money (`ledger --json` has them)
        assert {job_id[:8] for job_id in ids} <= set(cells), cells
    if width < 120:
        assert any(line.startswith(f"not shown at {width} columns: ") for line in lines), lines


def test_prices_list_says_each_source_once_below_where_it_would_wrap(ledger_env) -> None:
    env, _ = ledger_env
    lines = _shown(env, 80, "prices", "list")
    body = [line for line in lines if line.startswith("│")]
    # a source never wraps (it took five lines a price before); only a bound's words may
    wrapped = [line for line in body if not line.split("│")[1].strip()]
    assert all(not line.split("│")[-2].strip() for line in wrapped), "\n".join(wrapped)
    assert len(wrapped) <= 4, "\n".join(wrapped)
    assert "[1] instances.vantage.sh us-east-1" in lines, lines
    assert "│ [1]" in "\n".join(body)


@pytest.mark.parametrize("width", WIDTHS)
def test_budgets_wrap_their_descriptions_not_their_scopes(ledger_env, width: int) -> None:
    env, _ = ledger_env
    lines = _shown(env, width, "budget", "show")
    cells = _cells(lines)
    assert set(SCOPES) <= set(cells), cells
    assert "not shown" not in "\n".join(lines)  # the description wraps; nothing is left out


@pytest.mark.parametrize("width", WIDTHS)
def test_pools_and_prices_fit(ledger_env, width: int) -> None:
    env, _ = ledger_env
    assert "acme/vision" in _cells(_shown(env, width, "capacity", "acme"))
    prices = _cells(_shown(env, width, "prices", "list"))
    assert "aws:p4d.24xlarge" in prices and "21.958" in prices, prices


def test_descriptions_give_way_before_names_and_keys() -> None:
    columns = (Col("scope"), Col("job", "name"), Col("why", "text"))
    rows = [("acme/vision/agent-7", "lr-width sweep/0003", "blocked by the hourly cap " * 4)]
    natural = 19 + 19 + len(rows[0][2]) + 10
    # a little too wide: only the description is wrapped
    assert layout(columns, rows, natural - 5) == {0: 19, 1: 19, 2: len(rows[0][2]) - 5}
    # narrower: the description is at its narrowest, then the name wraps at its space
    assert layout(columns, rows, 19 + 19 + TEXT_LEAST + 10 - 4) == {0: 19, 1: 15, 2: TEXT_LEAST}


def test_what_cannot_fit_is_left_out_least_important_first() -> None:
    columns = (
        Col("id"),
        Col("scope"),
        Col("note", "text", drop=3),
        Col("state", drop=1),
        Col("run", drop=2),
    )
    rows = [("1eb5c3d2", "acme/vision/agent-7", "a reason", "admitted", "")]
    # id, scope and state are 8 + 19 + 8 wide, with 10 columns of rules and padding
    assert list(layout(columns, rows, 48)) == [0, 1, 3]
    # the note fits in what is left before the run, which has nothing in it
    assert list(layout(columns, rows, 59)) == [0, 1, 2, 3]
    # scopes and ids are never left out, even when they cannot fit
    assert layout(columns, rows, 20) == {0: 8, 1: 19}


def test_spend_per_scope_and_period_as_a_table_json_and_csv(ledger_env) -> None:
    import csv
    import io
    import json

    env, _ = ledger_env
    lines = _shown(env, 80, "spend")
    cells = _cells(lines)
    assert set(SCOPES) <= set(cells) and "$1,234.57" in cells, lines
    [acme] = [
        r
        for r in json.loads(_cli(env, 80, "spend", "acme", "--json").stdout)
        if r["scope"] == "acme"
    ]
    assert acme["period"] == "month" and acme["period_budget_usd"] == 2000.0
    assert acme["spent_usd"] == pytest.approx(acme["settled_usd"] + acme["reserved_usd"])
    rows = list(csv.DictReader(io.StringIO(_cli(env, 80, "spend", "--csv").stdout)))
    assert {r["scope"] for r in rows} == set(SCOPES), rows
    assert _cli(env, 80, "spend", "--period", "week", "--json").stdout.strip() == "[]"


def test_a_command_that_does_not_exist_names_the_one_meant(ledger_env) -> None:
    env, _ = ledger_env
    done = _cli(env, 80, "costs")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: No such command 'costs'. Did you mean `prefect-gpu-budget spend`?"
    )
