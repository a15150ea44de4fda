"""What an agent reads through the gateway when its trials misbehave or its worker dies, against
the house as the README deploys it: a real `prefect server start`, `prefect-gpu-budget serve`
running the agent deployment (trials sandboxed as user nobody), the gateway (`agents serve`)
and a PostgreSQL ledger. Both doors are read: REST and MCP answer alike.

- A trial that writes a finite loss, then `NaN`, `1e999` and `-Infinity`: its metric stays the
  finite loss, the three are counted, and the best trial, results and curves read finite values.
- The process running a sweep is SIGKILLed in its fourth of five trials (its runner reports the
  run Crashed) and reconcile settles the trial it held: the door reports the three finished
  trials as finished, with their metrics and cost, each billed once, and says the worker was
  lost and what starting it again would re-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.conftest import PG_URL
from tests.support.gateway import GatewayStack
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent jobs switch to user nobody")

SESSION = "acme/agents/agent-lost"
TRIAL = (
    "import json, os, sys, time\n"
    "lr = float(sys.argv[1])\n"
    "o, c = chr(123), chr(125)\n"
    "out = open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a', buffering=1)\n"
    "out.write(json.dumps(dict(step=0, loss=lr)) + '\\n')\n"
    "if lr == 0.2:\n"
    "    for bad in ('NaN', '1e999', '-Infinity'):\n"
    "        out.write(o + '\"step\": 1, \"loss\": ' + bad + c + '\\n')\n"
    "if lr == 0.4:\n"
    "    time.sleep(600)\n"
)
"""A trial reporting its `lr` as its loss; at lr 0.2 it writes NaN, 1e999 (parsed as infinity)
and -Infinity after it; at lr 0.4 it runs until its worker is killed. No braces: a command's
`{name}` is a placeholder."""


def _spec(name: str, lrs: list[float]) -> dict[str, Any]:
    return {
        "name": name,
        "job": {"instance_type": "local:box", "max_runtime": "5m", "kill_grace": "1s"},
        "command": ["python", "-c", TRIAL, "{lr}"],
        "grid": {"lr": lrs},
        "parallelism": 1,
        "metric": "loss",
        "goal": "min",
    }


@pytest.fixture(scope="module")
def house(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lost")
    with fresh_database(PG_URL) as url:
        from prefect_gpu_budget.pricing.catalog import set_local_price

        prices = set_local_price("box", "3.6", path=tmp / "prices.csv")
        ledger = Ledger(url)
        ledger.config.set_budget(
            BudgetRule("acme", hourly_cap_cents=2000, period_budget_micro=10**8)
        )
        ledger.config.set_session_template(
            BudgetRule(
                "acme/agents", hourly_cap_cents=360, period_budget_micro=5 * 10**6, period="day"
            )
        )
        server = PrefectServer(tmp / "home").start()
        env = server.client_env(
            PREFECT_GPU_BUDGET_LEDGER_URL=url,
            PREFECT_GPU_BUDGET_PRICES=str(prices),
            PREFECT_GPU_BUDGET_AGENT_USER="nobody",
            PREFECT_GPU_BUDGET_LOCAL_MACHINE="local:box",
            PREFECT_GPU_BUDGET_AGENT_RESULTS=str(tmp / "agent-results"),
        )
        try:
            with GatewayStack(env, tmp) as stack:
                granted = subprocess.run(
                    [sys.executable, "-m", "prefect_gpu_budget.cli", "agent", "grant", SESSION],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                assert granted.returncode == 0, granted.stderr
                yield {
                    "ledger": ledger,
                    "gateway": stack.client(),
                    "token": granted.stdout.strip(),
                    "server": server,
                }
        finally:
            server.stop()
            ledger.db.dispose()


def _view(house: dict[str, Any], run_id: str, wait: int = 0) -> dict[str, Any]:
    code, view = house["gateway"].call("GET", f"/v1/sweeps/{run_id}?wait={wait}", house["token"])
    assert code == 200, view
    return view


def _until(house: dict[str, Any], run_id: str, done: Any, timeout: float = 240) -> dict:
    """Long-poll the sweep until `done(view)`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = _view(house, run_id, wait=10)
        if done(view):
            return view
    raise AssertionError(f"sweep {run_id}: {view['state']} after {timeout:.0f}s: {view}")


def _mcp_view(house: dict[str, Any], run_id: str) -> dict[str, Any]:
    from tests.agents.mcp_client import call_tool

    url = house["gateway"].base + "/mcp"
    error, content = call_tool(url, house["token"], "get_sweep", {"run_id": run_id})
    assert not error, content
    return json.loads(content[0].text)


def _start(house: dict[str, Any], spec: dict[str, Any]) -> str:
    code, started = house["gateway"].call("POST", "/v1/sweeps", house["token"], spec)
    assert code == 201, started
    return started["run_id"]


def test_nan_and_infinities_never_erase_a_trials_metric(house):
    run_id = _start(house, _spec("nonfinite", [0.2, 0.3]))
    view = _until(house, run_id, lambda v: v["state"] in ("Completed", "Failed", "Crashed"))
    assert view["state"] == "Completed", view
    [nan, plain] = view["trials"]
    assert nan["outcome"] == plain["outcome"] == "completed"
    assert nan["metrics"] == {"loss": 0.2} and nan["non_finite_dropped"] == 3
    assert view["worker_lost"] is False
    assert plain["metrics"] == {"loss": 0.3} and plain["non_finite_dropped"] == 0
    assert view["best"] == {"trial": 0, "metric": "loss", "goal": "min", "value": 0.2}
    assert "best loss 0.2 (trial 0)" in view["message"]
    gw, token = house["gateway"], house["token"]
    code, curve = gw.call("GET", f"/v1/sweeps/{run_id}/trials/0/metrics", token)
    assert code == 200 and curve["records"] == [{"step": 0, "loss": 0.2}, *[{"step": 1}] * 3]
    code, results = gw.call("GET", f"/v1/sweeps/{run_id}/results", token)
    assert code == 200, results
    rows = json.loads(results["text"]) if "text" in results else results
    assert [(r["loss"], r["non_finite_dropped"]) for r in rows] == [(0.2, 3), (0.3, 0)]
    code, summary = gw.call("GET", f"/v1/sweeps/{run_id}/summary", token)
    assert "best trial 0: loss 0.2" in summary["text"]
    assert _mcp_view(house, run_id) == _view(house, run_id)


def test_a_sweep_whose_worker_was_killed_reports_what_finished_and_was_billed(house):
    ledger = house["ledger"]
    run_id = _start(house, _spec("lost", [0.1, 0.2, 0.3, 0.4, 0.5]))

    def held() -> dict | None:  # trial 3 runs, the three before it settled
        rows = {r["name"]: r for r in ledger.views.jobs(SESSION, flow_run_id=run_id)}
        fourth = rows.get("lost/0003")
        return fourth if fourth and fourth["state"] == "running" else None

    fourth = wait_for(held, 240, "the sweep's fourth trial running")
    holder = int(fourth["holder"].rsplit(":", 2)[1])  # the process running the sweep
    os.kill(holder, signal.SIGKILL)
    crashed = _until(house, run_id, lambda v: v["state"] == "Crashed", 120)
    assert crashed["worker_lost"] is True
    assert "worker lost: 3 of 5 trials finished" in crashed["message"], crashed

    def settled() -> bool:  # its job tree dies with its holder; reconcile settles what it ran
        reconcile(ledger)
        return ledger.views.job(fourth["id"])["state"] == "settled"

    wait_for(settled, 60, "reconcile to settle the trial the dead worker held")
    view = _view(house, run_id)
    assert view["state"] == "Crashed" and view["worker_lost"] is True, view
    trials = view["trials"]
    assert [t["outcome"] for t in trials] == ["completed"] * 3 + ["reconciled", None]
    assert [t["state"] for t in trials] == ["settled"] * 4 + ["not_started"]
    assert [t["metrics"] for t in trials[:3]] == [{"loss": 0.1}, {"loss": 0.2}, {"loss": 0.3}]
    assert [t["non_finite_dropped"] for t in trials] == [0, 3, 0, 0, 0]
    assert all(t["cost_usd"] > 0 for t in trials[:4]), trials
    assert view["best"] == {"trial": 0, "metric": "loss", "goal": "min", "value": 0.1}

    rows = ledger.views.jobs(SESSION, flow_run_id=run_id)
    assert sorted(r["name"] for r in rows) == [f"lost/{i:04d}" for i in range(4)]  # once each
    billed = sum(r["actual_micro"] for r in rows)
    assert view["spent_usd"] == billed / 1_000_000
    finished = sum(r["actual_micro"] for r in rows if r["outcome"] == "completed")
    from prefect_gpu_budget.units import fmt_usd

    assert view["message"] == (
        f"worker lost: 3 of 5 trials finished (billed {fmt_usd(finished)}); 1 stopped, failed "
        f"or cancelled (billed {fmt_usd(billed - finished)}); 1 never started; starting it "
        "again re-runs all 5"
    )
    assert _mcp_view(house, run_id) == view  # one door, one answer
