"""Agents through the API, against a real `prefect server start` (UI included).

The sweep deployment is served by `prefect-gpu-budget serve`; a trusted client (an admin's
script, a schedule) creates a flow run over HTTP naming a session; the session gets its team's
template budget; the ledger holds the charges; headless Chromium finds the trials table and a plot on the run's artifacts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.support.prefect_server import free_port as _free_port
from tests.support.prefect_server import http as _http
from tests.support.prefect_server import stop_groups
from tests.support.prefect_server import wait_for as _wait_for

SESSION = "acme/agents/agent-7"
SPEC = """
name: agent-sweep
scope: acme/agents
job: {instance_type: "local:box", max_runtime: 30s, kill_grace: 1s}
command: [%(python)s, -c, "import json,os,sys,time; time.sleep(3); f=open(os.environ['GPU_BUDGET_METRICS_FILE'],'a'); [f.write(json.dumps(dict(step=s, loss=float(sys.argv[1])/s))+chr(10)) for s in (1,2,3)]; f.write(json.dumps(dict(summary=True, loss=float(sys.argv[1])/3))+chr(10))", "{lr}"]
grid: {lr: [0.1, 0.3, 0.9]}
parallelism: 3
# each trial runs 3 s: the session's cap fits two, so the third always waits (its reason is shown)
results_dir: results
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real server, the deployments served, and one agent-triggered sweep run to completion."""
    tmp = tmp_path_factory.mktemp("api")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")},
        "PREFECT_HOME": str(tmp / "home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"{base}/api",
        "PREFECT_SERVER_UI_API_URL": f"{base}/api",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=(tmp / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    procs = [server]
    try:
        _wait_for(lambda: _http(f"{base}/api/health"), 120, "the Prefect server")
        from prefect_gpu_budget.pricing.catalog import set_local_price

        prices = set_local_price("box", "3.6", path=tmp / "prices.csv")
        ledger_url = f"sqlite:///{tmp / 'ledger.db'}"
        ledger = Ledger(ledger_url)
        ledger.config.set_budget(
            BudgetRule("acme", hourly_cap_cents=2000, period_budget_micro=100_000_000)
        )
        ledger.config.set_session_template(
            BudgetRule(
                "acme/agents", hourly_cap_cents=720, period_budget_micro=5_000_000, period="day"
            )
        )
        (tmp / "spec.yaml").write_text(SPEC % {"python": json.dumps(sys.executable)})
        agent_env = {
            **env,
            "PREFECT_API_URL": f"{base}/api",
            "PREFECT_GPU_BUDGET_LEDGER_URL": ledger_url,
            "PREFECT_GPU_BUDGET_PRICES": str(prices),
        }
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect_gpu_budget.cli",
                "serve",
                "--sweep",
                str(tmp / "spec.yaml"),
            ],
            env=agent_env,
            cwd=tmp,
            stdout=(tmp / "serve.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(serve)
        deployment = _wait_for(
            lambda: _http(f"{base}/api/deployments/name/gpu-sweep/sweep"),
            120,
            "the sweep deployment",
        )
        # The agent: one HTTP call naming its session.
        run = _http(
            f"{base}/api/deployments/{deployment['id']}/create_flow_run",
            {"parameters": {"scope": SESSION}},
        )
        final = _wait_for(
            lambda: (
                (r := _http(f"{base}/api/flow_runs/{run['id']}"))["state_type"]
                in ("COMPLETED", "FAILED", "CRASHED")
                and r
            ),
            240,
            "the agent's sweep run",
        )
        yield {"base": base, "run": final, "ledger": ledger, "tmp": tmp}
    finally:
        stop_groups(list(reversed(procs)))


@pytest.mark.timeout(600)
def test_agent_triggers_a_sweep_over_http(served):
    assert served["run"]["state_type"] == "COMPLETED", (served["tmp"] / "serve.log").read_text()[
        -3000:
    ]
    ledger = served["ledger"]
    [budget] = [b for b in ledger.config.budgets() if b.scope == SESSION]
    assert budget.period_budget_micro == 5_000_000 and budget.hourly_cap_cents == 720
    rows = ledger.views.jobs(SESSION)
    assert len(rows) == 3 and all(r["state"] == "settled" for r in rows)
    assert all(r["flow_run_id"] == served["run"]["id"] for r in rows)
    assert sum(r["actual_micro"] for r in rows) > 0


CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromedriver")
NEEDS_CHROMIUM = "GPU_BUDGET_UI_TEST"
"""Set (as .ci/run sets it) where the UI test must run: a missing Chromium then fails it."""


def _no_chromium() -> str:
    """Why the UI test cannot run here ('' where it can, or must)."""
    missing = [path for path in CHROMIUM if not os.access(path, os.X_OK)]
    if not missing or os.environ.get(NEEDS_CHROMIUM):
        return ""
    return (
        f"needs Debian's chromium and chromium-driver ({', '.join(missing)} missing): "
        "apt-get install chromium chromium-driver (.ci/run installs them)"
    )


@pytest.mark.skipif(bool(_no_chromium()), reason=_no_chromium())
@pytest.mark.timeout(300)
def test_ui_shows_the_trials_table_and_a_plot(served):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1100",
        f"--user-data-dir={served['tmp'] / 'chrome'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    shots = served["tmp"] / "screenshots"
    shots.mkdir(exist_ok=True)
    try:
        artifacts = _http(
            f"{served['base']}/api/artifacts/filter",
            {"artifacts": {"flow_run_id": {"any_": [served["run"]["id"]]}}},
        )
        by_key = {a["key"]: a for a in artifacts if a["key"]}
        # the trials table
        driver.get(f"{served['base']}/artifacts/artifact/{by_key['agent-sweep-trials']['id']}")
        _wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "table td"), 60, "the trials table")
        text = driver.find_element(By.TAG_NAME, "body").text
        assert "Completed" in text and "0.9" in text
        driver.save_screenshot(str(shots / "trials.png"))
        # the summary with its plots
        driver.get(f"{served['base']}/artifacts/artifact/{by_key['agent-sweep-summary']['id']}")
        images = _wait_for(
            lambda: [
                img
                for img in driver.find_elements(By.CSS_SELECTOR, "img[src^='data:image/png']")
                if driver.execute_script(
                    "return arguments[0].complete && arguments[0].naturalWidth", img
                )
            ],
            60,
            "a rendered plot",
        )
        assert len(images) >= 2
        driver.save_screenshot(str(shots / "summary.png"))
        # the run's page: its logs say why a trial waited, its Artifacts tab lists the results
        driver.get(f"{served['base']}/runs/flow-run/{served['run']['id']}")
        body = lambda: driver.find_element(By.TAG_NAME, "body").text  # noqa: E731
        _wait_for(
            lambda: "waits: hourly cap of acme/agents/agent-7" in body(), 60, "the wait reason"
        )
        driver.save_screenshot(str(shots / "run.png"))
        tab = driver.find_element(By.CSS_SELECTOR, "li.p-tab#artifacts")
        driver.execute_script("arguments[0].scrollIntoView(); arguments[0].click();", tab)
        _wait_for(
            lambda: "agent-sweep-trials" in body() and "agent-sweep-summary" in body(),
            60,
            "artifacts",
        )
        driver.save_screenshot(str(shots / "run-artifacts.png"))
    except Exception:
        driver.save_screenshot(str(shots / "failure.png"))
        (shots / "failure.html").write_text(driver.page_source)
        raise AssertionError(f"see {shots / 'failure.png'}: {driver.current_url}") from None
    finally:
        driver.quit()
    assert (shots / "summary.png").stat().st_size > 10_000
