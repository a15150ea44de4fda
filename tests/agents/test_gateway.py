"""The hostile agent, through the gateway only, against the house as the README deploys it.

A real `prefect server start` closed with an auth string, `prefect-gpu-budget serve` running the
agent deployment with the auth string and the admin's secrets in its environment, the gateway
(`prefect-gpu-budget agents serve`) likewise, and a PostgreSQL ledger whose URL carries a
password. The agent holds a token and the gateway's URL: every attack is refused or harmless,
and the planted secrets appear in no log, artifact, event, parameter, state or response.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.admin_settings import AgentLimits
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.agents.limits import STOPPED_BY_AGENT
from tests.conftest import PG_URL
from tests.support.gateway import GatewayClient, GatewayStack
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, wait_for
from tests.support.prefect_server import http as prefect_http

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent jobs switch to user nobody")

MARK = secrets.token_hex(6)
AUTH = f"admin:planted-auth-{MARK}"
PASSWORD = f"planted-pw-{MARK}"
AWS_SECRET = f"planted-aws-{MARK}"
PLANTED = (AUTH, PASSWORD, AWS_SECRET, f"planted-auth-{MARK}")
SESSION, OTHER, SLOW = "acme/agents/agent-7", "acme/agents/agent-8", "acme/slow/agent-9"
REPORT = """echo '{{"summary": true, "loss": 0.5}}' >> "$GPU_BUDGET_METRICS_FILE" """
"""A trial's report in shell: the sandbox user may not reach this machine's Python (under a
home folder closed to it), and a shell is all these probes need. Braces are doubled: a command's
`{name}` is a placeholder."""


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        capture_output=True,
        text=True,
    )


def _spec(**changes: object) -> dict:
    spec = {
        "name": "probe",
        "job": {"instance_type": "local:box", "max_runtime": "60s", "kill_grace": "1s"},
        "command": ["sh", "-c", REPORT],
        "grid": {"lr": [0.1]},
        "parallelism": 2,
    }
    return {**spec, **changes}


@pytest.fixture(scope="module")
def house(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("house")
    with fresh_database(PG_URL) as plain:
        url = plain.replace("//postgres@", f"//postgres:{PASSWORD}@")  # trust auth ignores it
        from prefect_gpu_budget.pricing.catalog import set_local_price

        prices = set_local_price("box", "3.6", path=tmp / "prices.csv")
        set_local_price("cheap", "0.01", path=prices)  # another machine's: not this worker's
        ledger = Ledger(url)
        ledger.config.set_budget(
            BudgetRule("acme", hourly_cap_cents=2000, period_budget_micro=10**8)
        )
        for team in ("acme/agents", "acme/slow"):
            ledger.config.set_session_template(
                BudgetRule(team, hourly_cap_cents=360, period_budget_micro=5 * 10**6, period="day")
            )
        ledger.grants.set_agent_limits(
            "acme/slow", AgentLimits(team="acme/slow", max_sweeps=1, max_queued=8).stored()
        )
        server = PrefectServer(tmp / "home", auth=AUTH).start()
        env = server.client_env(
            PREFECT_GPU_BUDGET_LEDGER_URL=url,
            PREFECT_GPU_BUDGET_PRICES=str(prices),
            AWS_ACCESS_KEY_ID="AKIAPLANTEDEXAMPLE",
            AWS_SECRET_ACCESS_KEY=AWS_SECRET,
            PREFECT_GPU_BUDGET_AGENT_USER="nobody",
            PREFECT_GPU_BUDGET_LOCAL_MACHINE="local:box",
            PREFECT_GPU_BUDGET_AGENT_RESULTS=str(tmp / "agent-results"),
            PREFECT_LOGGING_LEVEL="INFO",  # the job's output reaches the run logs (searched below)
        )
        try:
            with GatewayStack(env, tmp) as stack:
                tokens = {}
                for session in (SESSION, OTHER, SLOW):
                    granted = _cli(env, "agent", "grant", session)
                    assert granted.returncode == 0, granted.stderr
                    tokens[session] = granted.stdout.strip()
                yield {
                    "tmp": tmp,
                    "ledger": ledger,
                    "server": server,
                    "gateway": stack.client(),
                    "tokens": tokens,
                    "env": env,
                    "stack": stack,
                }
        finally:
            server.stop()
            ledger.db.dispose()


def _admin(house, path: str, body: dict | None = None) -> object:
    return prefect_http(f"{house['server'].api}{path}", body, auth=AUTH)


def _every(house, path: str) -> list:
    """All rows a filter endpoint has, page by page."""
    rows: list = []
    while True:
        page = _admin(house, path, {"limit": 200, "offset": len(rows)})
        rows += page
        if len(page) < 200:
            return rows


def _events(house) -> list:
    """Every event of the last hour (the server's default window), page by page."""
    page = _admin(house, "/events/filter", {"limit": 50})
    events = list(page["events"])
    while page.get("next_page"):
        page = prefect_http(page["next_page"], auth=AUTH)
        events += page["events"]
    assert events, "no events at all: the search below would prove nothing"
    return events


def test_the_prefect_api_is_closed_to_anyone_without_the_auth_string(house):
    api = house["server"].api
    attacks = [
        ("/flow_runs/filter", {}),
        ("/block_documents/filter", {"include_secrets": True}),
        (
            "/v2/concurrency_limits/increment-with-lease",
            {"names": ["gpu-budget:acme"], "slots": 10000},
        ),
        ("/deployments/filter", {}),
    ]
    for path, body in attacks:
        for auth in (None, "admin:guess"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                prefect_http(api + path, body, auth=auth)
            assert refused.value.code == 401, path
    assert isinstance(_admin(house, "/flow_runs/filter", {}), list)  # the admin's string works


def test_a_token_opens_its_own_session_and_nothing_else(house):
    gw, token = house["gateway"], house["tokens"][SESSION]
    for header_token in (None, "", "gpub_forged", token + "x", "' OR 1=1 --"):
        code, body = gw.call("GET", "/v1/status", header_token)
        assert code == 401 and body["detail"] == "unknown or revoked token", header_token
    code, status = gw.call("GET", "/v1/status", token)
    assert code == 200 and status["session"] == SESSION
    assert status["budget"]["hourly_cap_usd"] == 3.6  # the team's template, nothing above it
    code, docs = gw.call("GET", "/openapi.json")
    assert code == 200 and {"/v1/sweeps", "/v1/status"} <= set(docs["paths"])


def test_an_agent_job_runs_sandboxed_and_cannot_reach_the_admins_keys(house):
    gw, token, ledger = house["gateway"], house["tokens"][SESSION], house["ledger"]
    attack = (
        "env; id -u; pwd; echo ledger=$PREFECT_GPU_BUDGET_LEDGER_URL; "
        "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -i -e secret -e ledger; "
        f"{sys.executable} -m prefect_gpu_budget.cli budget set acme --hourly-cap 1000000; "
        f"{sys.executable} -m prefect_gpu_budget.cli agent grant acme/agents/agent-x; "
        f"echo $$ > {house['tmp']}/escaped; " + REPORT
    )
    code, started = gw.call("POST", "/v1/sweeps", token, _spec(command=["sh", "-c", attack]))
    assert code == 201, started
    run = gw.sweep_until_done(token, started["run_id"])
    assert run["state"] == "Completed", run
    [trial] = run["trials"]
    assert trial["state"] == "settled" and run["spent_usd"] > 0

    [budget] = [b for b in ledger.config.budgets() if b.scope == "acme"]
    assert budget.hourly_cap_cents == 2000, "an agent's job changed the org's budget"
    assert not [s for s in ledger.config.session_templates() if "agent-x" in s.scope]
    assert not (house["tmp"] / "escaped").exists(), "the job could write into the admin's folder"

    def job_output() -> list[str]:  # run logs reach the server in batches: all, once its last
        mine = {"logs": {"flow_run_id": {"any_": [started["run_id"]]}}, "limit": 200}
        lines = [log["message"] for log in _admin(house, "/logs/filter", mine)]
        return lines if any(line.startswith("Finished in state") for line in lines) else []

    lines = wait_for(job_output, 60, "the job's output in the run logs")
    assert "| 65534" in lines, f"the job did not run as nobody: {lines}"
    assert not any("PREFECT_GPU_BUDGET_LEDGER_URL=" in line for line in lines)
    params = [r["parameters"] for r in _admin(house, "/flow_runs/filter", {})]
    assert params and not any("token" in json.dumps(p) for p in params)
    assert house["tokens"][SESSION] not in json.dumps(params)


def _network_probe(db: str, ports: dict[str, int]) -> str:
    """What a hostile trial tries (a Python program without braces, which the spec's
    placeholders would read): `psql` into the ledger's database as the superuser, TCP to each
    of `ports` on the host's loopback, and a count of the processes its /proc shows; it
    reports as a summary metric."""
    tries = ", ".join(f"{name}=tcp({port})" for name, port in ports.items())
    return (
        "import json, os, socket, subprocess\n"
        "def tcp(port):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=5).close()\n"
        "        return 'open'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        f"sql = ['psql', '-h', '127.0.0.1', '-U', 'postgres', '-d', {db!r}, '-c',"
        " 'create table pwned_by_agent (x int)']\n"
        "psql = subprocess.run(sql, capture_output=True).returncode\n"
        "procs = sum(p.isdigit() for p in os.listdir('/proc'))\n"
        f"report = dict(summary=True, loss=0.5, psql=psql, procs=procs, {tries})\n"
        "with open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a') as f:\n"
        "    f.write(json.dumps(report) + chr(10))\n"
    )


def test_an_agent_job_reaches_no_service_of_its_host(house):
    """From inside a sweep's trial, as a hostile agent would: the ledger's PostgreSQL (which
    trusts local connections), the Prefect API and the gateway, all on the host's loopback,
    are out of reach, and its /proc shows its own processes only."""
    gw, token, ledger = house["gateway"], house["tokens"][SESSION], house["ledger"]
    db = ledger.db.engine.url.database
    ports = {
        "ledger": 5432,
        "api": urllib.parse.urlsplit(house["server"].api).port,
        "gateway": urllib.parse.urlsplit(gw.base).port,
    }
    probe = _network_probe(db, ports)
    code, started = gw.call("POST", "/v1/sweeps", token, _spec(command=["python3", "-c", probe]))
    assert code == 201, started
    run = gw.sweep_until_done(token, started["run_id"])
    assert run["state"] == "Completed", run
    [trial] = run["trials"]
    seen = trial["metrics"]
    assert {name: seen.get(name) for name in ports} == dict.fromkeys(
        ports, "ConnectionRefusedError"
    ), seen  # the job's own loopback: nothing of the host's listens there
    assert seen["psql"] != 0 and 0 < seen["procs"] <= 6, seen
    with ledger.db.engine.connect() as conn:
        tables = conn.exec_driver_sql(
            "select count(*) from pg_tables where tablename = 'pwned_by_agent'"
        ).scalar_one()
    assert tables == 0, "the agent's job wrote into the ledger's database"


REFUSED = {
    "another scope": (_spec(scope="acme/agents"), "may spend only in"),
    "a budget in the spec": (_spec(hourly_cap_usd=999), "hourly_cap_usd"),
    "a callable not allowed": (
        {**{k: v for k, v in _spec().items() if k != "command"}, "callable": "os:system"},
        "callable",
    ),
    "another team's launcher": (_spec(launcher="sagemaker:nlp-team"), "launcher"),
    "a deployment launcher": (_spec(launcher="deployment:anything"), "launcher"),
    "top priority": (_spec(job={**_spec()["job"], "priority": 1000}), "job.priority"),
    "waiting forever": (_spec(job={**_spec()["job"], "max_wait": 0}), "job.max_wait"),
    "waiting a month": (_spec(job={**_spec()["job"], "max_wait": "30d"}), "job.max_wait"),
    "a huge format spec": (_spec(command=["echo", "{lr:>400000000}"]), "command"),
    "an absolute results dir": (_spec(results_dir="/etc/cron.d"), "results_dir"),
    "a results dir above its root": (_spec(results_dir="../../admin"), "results_dir"),
    "too many trials": (_spec(grid={"lr": list(range(101))}), "grid"),
    "more at once than may queue": (_spec(parallelism=64), "parallelism"),
    "a malformed grid": (_spec(grid="lr=1"), "grid"),
    "not a mapping": ([1, 2], "body"),
    "a cloud's cheap spot price for a local job": (
        _spec(job={**_spec()["job"], "instance_type": "gcp:g2-standard-4", "provisioning": "spot"}),
        "instance_type",
    ),
    "another machine's price for a job run here": (
        _spec(job={**_spec()["job"], "instance_type": "local:cheap"}),
        "priced as local:box",
    ),
}


@pytest.mark.parametrize("attack", REFUSED)
def test_a_spec_beyond_the_agents_limits_is_a_422_and_reserves_nothing(house, attack):
    gw, token, ledger = house["gateway"], house["tokens"][SESSION], house["ledger"]
    spec, field = REFUSED[attack]
    before = (len(ledger.views.jobs()), len(_admin(house, "/flow_runs/filter", {})))
    code, body = gw.call("POST", "/v1/sweeps", token, spec)
    assert code == 422, body
    assert "\n" not in body["detail"] and field in body["detail"], body
    assert (len(ledger.views.jobs()), len(_admin(house, "/flow_runs/filter", {}))) == before


def test_big_or_unsized_bodies_are_refused_before_parsing(house):
    gw, token = house["gateway"], house["tokens"][SESSION]
    code, _ = gw.call("POST", "/v1/sweeps", token, raw=b"[" + b"1," * 40_000 + b"1]")
    assert code == 413
    code, _ = gw.call("POST", "/v1/sweeps", token, raw=b"{not json")
    assert code == 422


def test_another_sessions_runs_and_jobs_look_like_absent_ones(house):
    gw, ledger = house["gateway"], house["ledger"]
    mine, theirs = house["tokens"][SESSION], house["tokens"][OTHER]
    [run] = [
        r
        for r in _admin(house, "/flow_runs/filter", {})
        if r["parameters"].get("session") == SESSION
    ][:1]
    job = ledger.views.jobs(SESSION)[0]["id"]
    absent = gw.call("GET", f"/v1/sweeps/{uuid.uuid4()}", theirs)
    other = gw.call("GET", f"/v1/sweeps/{run['id']}", theirs)
    assert absent[0] == other[0] == 404
    assert gw.call("GET", "/v1/sweeps/not-a-uuid", theirs)[0] == 404
    assert gw.call("GET", f"/v1/sweeps/{run['id']}", mine)[0] == 200
    for job_id in (job, str(uuid.uuid4()), "../x"):
        code, _ = gw.call("POST", f"/v1/jobs/{job_id}/cancel", theirs, raw=b"")
        assert code == 404, job_id
    assert ledger.views.job(job)["state"] == "settled"


def test_revocation_cancels_queued_jobs_and_admits_nothing_more(house):
    """A session capped at one job at a time runs a 6-trial sweep, 4 at once; a second sweep is
    past its limit (429); revoking the token cancels the queued trials at once, admits none
    later, and the sweep starts none of its last two."""
    gw, token, ledger = house["gateway"], house["tokens"][SLOW], house["ledger"]
    spec = _spec(
        command=["sh", "-c", f"sleep 30; {REPORT}"], grid={"lr": [1, 2, 3, 4, 5, 6]}, parallelism=4
    )  # the first trial runs on past the revocation, on a loaded host too
    code, started = gw.call("POST", "/v1/sweeps", token, spec)
    assert code == 201, started
    code, body = gw.call("POST", "/v1/sweeps", token, spec)
    assert code == 429 and "at most 1" in body["detail"], body
    wait_for(  # all four asked for: none is asked for after the revocation (and refused)
        lambda: sum(j["state"] == "queued" for j in ledger.views.jobs(SLOW)) == 3,
        120,
        "queued trials",
    )
    revoked = _cli(house["env"], "agent", "revoke", SLOW)
    assert revoked.returncode == 0, revoked.stderr
    assert not [j for j in ledger.views.jobs(SLOW) if j["state"] == "queued"]
    assert gw.call("GET", "/v1/status", token)[0] == 401
    code, _ = gw.call("GET", f"/v1/sweeps/{started['run_id']}", house["tokens"][SESSION])
    assert code == 404  # another agent still cannot look
    run = wait_for(
        lambda: (
            (r := _admin(house, f"/flow_runs/{started['run_id']}"))["state_type"]
            in ("COMPLETED", "FAILED", "CRASHED")
            and r
        ),
        180,
        "the revoked sweep to end",
    )
    assert run["state_type"] == "COMPLETED", run["state"]
    assert len(ledger.views.jobs(SLOW)) == 4, "the sweep started trials after its grant was revoked"
    assert all(j["state"] in ("settled", "cancelled") for j in ledger.views.jobs(SLOW))
    started_jobs = [j for j in ledger.views.jobs(SLOW) if j["started_at"]]
    assert len(started_jobs) == 1, "a trial was admitted after its grant was revoked"


def test_no_planted_secret_reached_any_log_artifact_event_state_or_response(house):
    found = {
        "logs": _every(house, "/logs/filter"),
        "artifacts": _every(house, "/artifacts/filter"),
        "flow runs": _every(house, "/flow_runs/filter"),
        "task runs": _every(house, "/task_runs/filter"),
        "events": _events(house),
        "gateway responses": house["gateway"].seen,
    }
    for where, items in found.items():
        text = json.dumps(items)
        for secret in PLANTED:
            assert secret not in text, f"a planted secret reached the {where}"


def test_results_stay_under_the_agents_root(house):
    root = Path(house["tmp"]) / "agent-results"
    assert list(root.glob("acme/agents/agent-7/*/probe-*/trials.csv"))


def test_a_prefect_api_that_is_down_is_a_503_not_a_traceback(tmp_path, prices, monkeypatch):
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_USER", "nobody")
    from fastapi.testclient import TestClient
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from prefect_gpu_budget.agents.gateway import create_app

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.config.set_session_template(BudgetRule("acme/agents", hourly_cap_cents=360))
    token = ledger.grants.grant_agent(SESSION)
    down = {PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES: 0}
    with temporary_settings(updates=down), TestClient(create_app(ledger.url)) as client:
        answer = client.post(
            "/v1/sweeps", json=_spec(), headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.status_code == 503, answer.text
        assert answer.json() == {"detail": "the Prefect API is unavailable"}
        mine = client.get("/v1/status", headers={"Authorization": f"Bearer {token}"})
        assert mine.status_code == 200 and mine.json()["session"] == SESSION  # the ledger answers


def test_the_rate_window_counts_within_its_span_and_forgets_idle_keys():
    from prefect_gpu_budget.agents.throttle import Window

    window = Window(2, 60.0)
    assert [window.hit("10.0.0.1") for _ in range(3)] == [False, False, True]
    assert window.full("10.0.0.1") and not window.full("10.0.0.2")
    brief = Window(1, 0.05)
    brief.hit("a")
    time.sleep(0.1)
    assert not brief.full("a") and not brief._seen  # nothing kept for a key gone quiet


# -- the agent's loop: start, watch, read results and plots, stop, forecast (REST and MCP) --

TRAIN = (
    "import json, os, sys, time\n"
    "lr, steps, pause = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])\n"
    "loss = 1.0\n"
    "for step in range(steps):\n"
    "    loss = loss * (1 - lr)\n"
    "    with open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a') as out:\n"
    "        out.write(json.dumps(dict(step=step, loss=loss)) + '\\n')\n"
    "    time.sleep(pause)\n"
    "with open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a') as out:\n"
    "    out.write(json.dumps(dict(summary=True, loss=loss)) + '\\n')\n"
)
"""A Python trial that reports a learning curve and a summary (no braces: they are placeholders)."""


def _train(lrs: list[float], steps: int = 4, pause: float = 0.2, **changes: object) -> dict:
    long = {"job": {**_spec()["job"], "max_runtime": "5m"}} if steps * pause > 30 else {}
    return _spec(
        name="train",
        command=["python", "-c", TRAIN, "{lr}", str(steps), str(pause)],
        grid={"lr": lrs},
        **{**long, **changes},
    )


def _until(gw: GatewayClient, token: str, run_id: str, done, timeout: float = 240) -> dict:
    """Long-poll the sweep (`?wait=`) until `done(view)`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, view = gw.call("GET", f"/v1/sweeps/{run_id}?wait=10", token)
        assert code == 200, view
        if done(view):
            return view
    raise AssertionError(f"sweep {run_id}: {view['state']} after {timeout:.0f}s: {view}")


def _ended(view: dict) -> bool:
    return view["state"] in ("Completed", "Failed", "Crashed", "Cancelled")


def _raw(
    gw: GatewayClient, path: str, token: str, accept: str | None = None
) -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {token}"}
    if accept:
        headers["Accept"] = accept
    request = urllib.request.Request(gw.base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("content-type", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read()


def test_an_agent_sees_its_sweeps_results_curves_and_plots_over_http(house):
    gw, token, theirs = house["gateway"], house["tokens"][SESSION], house["tokens"][OTHER]
    code, forecast = gw.call("POST", "/v1/forecast", token, _train([0.1, 0.3, 0.5]))
    assert code == 200 and forecast["trials"] == 3 and forecast["admitted"] == 3, forecast
    assert forecast["spend_usd"] > 0 and forecast["makespan_s"] > 0
    assert forecast["likely"]["admitted"] == 3 and forecast["bound"]["runtime_s"] == 61.0
    code, quote = gw.call("GET", "/v1/quote?instance_type=local:box&hours=2", token)
    assert code == 200 and quote["usd_per_hour"] == 3.6 and quote["usd"] == 7.2, quote

    code, started = gw.call("POST", "/v1/sweeps", token, _train([0.1, 0.3, 0.5]))
    assert code == 201, started
    run = started["run_id"]
    view = _until(gw, token, run, _ended)
    assert view["state"] == "Completed", view
    assert [t["params"] for t in view["trials"]] == [{"lr": 0.1}, {"lr": 0.3}, {"lr": 0.5}]
    for trial in view["trials"]:
        assert trial["outcome"] == "completed" and trial["cost_usd"] > 0, trial
        assert trial["reason"] == "", trial  # never the admission's words
        assert trial["metrics"]["loss"] == pytest.approx((1 - trial["params"]["lr"]) ** 4)
    assert view["best"] == {
        "trial": 2,
        "metric": "loss",
        "goal": "min",
        "value": pytest.approx(0.5**4),
    }
    assert "3 of 3 trials completed" in view["message"] and view["spent_usd"] > 0
    # asked again, the likely figures take the runtime its finished trials showed
    code, again = gw.call("POST", "/v1/forecast", token, _train([0.1, 0.3, 0.5]))
    assert (
        code == 200
        and again["runtime_from"] == "as each last ran, the mean of its 3 finished trials"
    ), again
    assert again["likely"]["runtime_s"] < 30 and again["bound"]["runtime_s"] == 61.0
    assert again["likely"]["spend_usd"] < again["bound"]["spend_usd"]

    code, curve = gw.call("GET", f"/v1/sweeps/{run}/trials/0/metrics?limit=3", token)
    assert code == 200 and [r["step"] for r in curve["records"]] == [0, 1, 2], curve
    code, rest = gw.call("GET", f"/v1/sweeps/{run}/trials/0/metrics?offset=3", token)
    assert [r.get("step") for r in rest["records"]] == [3, None] and rest["next_offset"] is None
    assert rest["records"][-1]["summary"] is True

    status, kind, body = _raw(gw, f"/v1/sweeps/{run}/results", token)
    rows = json.loads(body)
    assert status == 200 and [r["lr"] for r in rows] == [0.1, 0.3, 0.5] and "loss" in rows[0]
    status, kind, body = _raw(gw, f"/v1/sweeps/{run}/results", token, accept="text/csv")
    assert status == 200 and kind.startswith("text/csv"), kind
    assert body.decode().splitlines()[0].startswith("trial,lr,loss")
    assert _raw(gw, f"/v1/sweeps/{run}/results?format=csv", token)[1:] == (kind, body)
    status, kind, body = _raw(gw, f"/v1/sweeps/{run}/plots", token)
    names = json.loads(body)
    assert {"metric_vs_params.png", "learning_curves.png", "spend.png"} <= set(names), names
    status, kind, png = _raw(gw, f"/v1/sweeps/{run}/plots/learning_curves.png", token)
    assert status == 200 and kind == "image/png" and png.startswith(b"\x89PNG"), kind
    status, kind, summary = _raw(gw, f"/v1/sweeps/{run}/summary", token)
    assert status == 200 and kind.startswith("text/markdown")
    assert "best trial 2" in summary.decode()

    for path in (
        f"/v1/sweeps/{run}",
        f"/v1/sweeps/{run}/trials/0/metrics",
        f"/v1/sweeps/{run}/results",
        f"/v1/sweeps/{run}/plots",
        f"/v1/sweeps/{run}/plots/spend.png",
        f"/v1/sweeps/{run}/summary",
    ):
        assert _raw(gw, path, theirs)[0] == 404, path
        assert _raw(gw, path.replace(run, str(uuid.uuid4())), token)[0] == 404, path
    assert gw.call("POST", f"/v1/sweeps/{run}/cancel", theirs, raw=b"")[0] == 404
    keys = {a["key"] for a in _every(house, "/artifacts/filter") if a.get("key")}
    keyed = re.compile(r"agent-acme-agents-agent-7-train-[0-9a-f]{10}-trials")
    assert any(keyed.fullmatch(k) for k in keys), keys  # keyed by its session
    assert "train-trials" not in keys  # never an admin's sweep named `train`


def _running_job(house, session: str, run_id: str) -> dict:
    """The sweep's job once it runs and has reported a record."""
    ledger = house["ledger"]

    def running() -> dict | None:
        rows = [
            j for j in ledger.views.jobs(session, flow_run_id=run_id) if j["state"] == "running"
        ]
        return rows[0] if rows else None

    return wait_for(running, 180, "a running trial")


def test_an_agent_stops_a_running_trial_and_pays_for_what_ran(house):
    gw, token, ledger = house["gateway"], house["tokens"][SESSION], house["ledger"]
    code, started = gw.call("POST", "/v1/sweeps", token, _train([0.01], steps=200, pause=0.3))
    assert code == 201, started
    run = started["run_id"]
    job = _running_job(house, SESSION, run)
    _until(gw, token, run, lambda v: v["trials"] and v["trials"][0]["records"] >= 2, 120)
    assert (
        gw.call("POST", f"/v1/jobs/{job['id']}/cancel", house["tokens"][OTHER], raw=b"")[0] == 404
    )
    asked = time.monotonic()
    code, stopped = gw.call("POST", f"/v1/jobs/{job['id']}/cancel", token, raw=b"")
    assert code == 200 and stopped["state"] == "stopping", stopped
    settled = wait_for(
        lambda: (row := ledger.views.job(job["id"]))["state"] == "settled" and row, 60, "the stop"
    )
    assert time.monotonic() - asked < 30  # a poll, the kill grace (1 s) and the holder's slack
    assert settled["outcome"] == "cancelled" and settled["reason"] == STOPPED_BY_AGENT
    assert 0 < settled["actual_micro"] < settled["reserved_micro"] / 2, settled
    view = _until(gw, token, run, _ended)
    [trial] = view["trials"]
    assert trial["outcome"] == "cancelled" and trial["reason"] == STOPPED_BY_AGENT, trial
    assert gw.call("POST", f"/v1/jobs/{job['id']}/cancel", token, raw=b"")[0] == 409
    # one wording of this stop: its row, the agent's view of its trial, and its run's message
    runs = _admin(house, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run]}}})
    [task_run] = [r for r in runs if r["name"].startswith("trial 0000")]
    said = task_run["state"]["message"]
    assert task_run["state"]["type"] == "CANCELLED" and STOPPED_BY_AGENT in said, said
    assert "by its owner" not in said
    [row] = json.loads(_raw(gw, f"/v1/sweeps/{run}/results", token)[2])  # its results table
    assert STOPPED_BY_AGENT in row["reason"], row


def test_an_agent_cancels_its_whole_sweep(house):
    gw, token, ledger = house["gateway"], house["tokens"][SESSION], house["ledger"]
    spec = _train([0.01, 0.02, 0.03, 0.04], steps=200, pause=0.3, parallelism=2)
    code, started = gw.call("POST", "/v1/sweeps", token, spec)
    assert code == 201, started
    run = started["run_id"]
    _running_job(house, SESSION, run)
    wait_for(
        lambda: any(j["state"] == "queued" for j in ledger.views.jobs(SESSION, flow_run_id=run)),
        120,
        "a queued trial (the session's cap runs one at a time)",
    )
    code, cancelled = gw.call("POST", f"/v1/sweeps/{run}/cancel", token, raw=b"")
    # what this call stopped: the sweep's own watch, seeing the sweep cancelled, may stop a
    # job first (then it counts here as stopping already, or not at all)
    assert code == 200 and cancelled["stopping"] <= 1 and cancelled["cancelled"] <= 1, cancelled
    view = _until(gw, token, run, _ended)
    assert view["cancelled"] and "cancelled" in view["message"], view
    rows = ledger.views.jobs(SESSION, flow_run_id=run)
    assert len(rows) == 2, "the sweep started trials after it was cancelled"
    assert all(j["state"] in ("settled", "cancelled") for j in rows)
    assert sum(1 for j in rows if j["started_at"]) == 1


def _processes_with(marker: str) -> list[int]:
    """This machine's live processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if entry.isdigit() and marker.encode() in handle.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_revoked_grant_leaves_no_process_of_its_session(house):
    """`agent revoke` stops the session's running jobs too: within seconds none of its
    processes is left, its trial is settled for what it ran, named for the revocation."""
    session = f"acme/agents/revoked-{uuid.uuid4().hex[:6]}"
    granted = _cli(house["env"], "agent", "grant", session)
    assert granted.returncode == 0, granted.stderr
    gw, token, ledger = house["gateway"], granted.stdout.strip(), house["ledger"]
    marker = f"revoked-{uuid.uuid4().hex}"
    command = ["sh", "-c", f"{REPORT}; sleep 600; echo {marker}"]
    code, started = gw.call("POST", "/v1/sweeps", token, _spec(command=command))
    assert code == 201, started
    job = _running_job(house, session, started["run_id"])
    wait_for(lambda: _processes_with(marker), 60, "the trial's processes")
    revoked = _cli(house["env"], "agent", "revoke", session)
    assert revoked.returncode == 0 and "1 running job(s) stopped" in revoked.stdout, revoked
    wait_for(lambda: not _processes_with(marker), 60, "the revoked session's processes to end")
    row = wait_for(
        lambda: (r := ledger.views.job(job["id"]))["state"] == "settled" and r, 120, "settlement"
    )
    assert row["outcome"] == "cancelled" and "grant was revoked" in row["reason"], row
    assert gw.call("GET", f"/v1/sweeps/{started['run_id']}", token)[0] == 401


def test_specs_that_cannot_run_are_refused_at_the_door(house):
    gw, token, ledger = house["gateway"], house["tokens"][SESSION], house["ledger"]
    before = (len(ledger.views.jobs()), len(_admin(house, "/flow_runs/filter", {})))
    typo = _spec(job={**_spec()["job"], "instance_type": "local:boxx"})
    code, body = gw.call("POST", "/v1/sweeps", token, typo)
    assert code == 422 and "did you mean local:box?" in body["detail"], body
    code, body = gw.call("POST", "/v1/sweeps", token, _spec(command=["no-such-trainer", "x"]))
    assert code == 422 and body["detail"].startswith("command:"), body
    code, body = gw.call("POST", "/v1/forecast", token, typo)
    assert code == 422 and "instance_type" in body["detail"]
    assert gw.call("GET", "/v1/quote?instance_type=aws:p4d.24xlarg", token)[0] == 422
    assert (len(ledger.views.jobs()), len(_admin(house, "/flow_runs/filter", {}))) == before


def test_nothing_serving_the_agent_deployment_is_a_503_and_starts_nothing(house, monkeypatch):
    from fastapi.testclient import TestClient

    from prefect_gpu_budget.agents.gateway import create_app

    [flow] = [f for f in _admin(house, "/flows/filter", {}) if f["name"] == "agent-sweep"]
    _admin(house, "/deployments/", {"name": "idle", "flow_id": flow["id"]})
    for name, value in house["env"].items():
        if name.startswith(("PREFECT_", "AWS_")):
            monkeypatch.setenv(name, value)
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {PREFECT_API_URL: house["server"].api, PREFECT_API_AUTH_STRING: AUTH}
    before = len(_admin(house, "/flow_runs/filter", {}))
    with (
        temporary_settings(updates=settings),
        TestClient(
            create_app(house["env"]["PREFECT_GPU_BUDGET_LEDGER_URL"], "agent-sweep/idle")
        ) as client,
    ):
        answer = client.post(
            "/v1/sweeps",
            json=_spec(),
            headers={"Authorization": f"Bearer {house['tokens'][SESSION]}"},
        )
    assert answer.status_code == 503 and "nothing serves" in answer.json()["detail"], answer.text
    assert len(_admin(house, "/flow_runs/filter", {})) == before


def test_the_same_loop_through_mcp_reveals_no_more_than_rest(house):
    from tests.agents.mcp_client import HTTPRefused, call_tool, list_tools

    gw, token, theirs = house["gateway"], house["tokens"][SESSION], house["tokens"][OTHER]
    url = gw.base + "/mcp"
    assert {"start_sweep", "get_sweep", "get_trial_metrics", "cancel_job", "cancel_sweep"} <= set(
        list_tools(url, token)
    )
    with pytest.raises(HTTPRefused) as refused:
        list_tools(url, "gpub_forged")
    assert refused.value.status == 401

    def tool(tool_name: str, who: str = token, /, **arguments: object) -> tuple[bool, list]:
        return call_tool(url, who, tool_name, arguments)

    error, content = tool("quote", instance_type="local:box", hours=2)
    assert not error and json.loads(content[0].text)["usd"] == 7.2
    error, content = tool("forecast_sweep", spec=_train([0.2, 0.4]))
    assert not error and json.loads(content[0].text)["trials"] == 2
    error, content = tool("start_sweep", spec=_train([0.2, 0.4]))
    assert not error, content
    run = json.loads(content[0].text)["run_id"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        error, content = tool("get_sweep", run_id=run, wait_s=10)
        view = json.loads(content[0].text)
        if _ended(view):
            break
    assert view["state"] == "Completed" and view["best"]["trial"] == 1, view
    rest = gw.call("GET", f"/v1/sweeps/{run}", token)[1]
    assert {k: v for k, v in rest.items()} == view  # one door, one answer
    error, content = tool("get_trial_metrics", run_id=run, trial=1)
    assert not error and len(json.loads(content[0].text)["records"]) == 5
    error, content = tool("get_results", run_id=run)
    assert [r["lr"] for r in json.loads(content[0].text)["results"]] == [0.2, 0.4]
    error, content = tool("get_results", run_id=run, format="csv")
    assert (
        not error
        and content[0].text == _raw(gw, f"/v1/sweeps/{run}/results?format=csv", token)[2].decode()
    )
    error, content = tool("get_plot", run_id=run, name="metric_vs_params.png")
    assert not error and content[0].type == "image" and content[0].mime_type == "image/png"
    error, content = tool("get_summary", run_id=run)
    assert not error and "best trial 1" in content[0].text
    error, content = tool("get_status")
    assert not error and json.loads(content[0].text)["session"] == SESSION

    for name, arguments in (
        ("get_sweep", {"run_id": run}),
        ("get_trial_metrics", {"run_id": run, "trial": 0}),
        ("get_results", {"run_id": run}),
        ("list_plots", {"run_id": run}),
        ("get_plot", {"run_id": run, "name": "spend.png"}),
        ("get_summary", {"run_id": run}),
        ("cancel_sweep", {"run_id": run}),
        ("cancel_job", {"job_id": view["trials"][0]["job_id"]}),
    ):
        error, content = tool(name, theirs, **arguments)
        assert error and content[0].text.startswith("404: "), (name, content)
    code, absent = gw.call("GET", f"/v1/sweeps/{run}", theirs)
    error, content = tool("get_sweep", theirs, run_id=run)
    assert content[0].text == f"{code}: {absent['detail']}"  # the same refusal, word for word


def test_the_mcp_steering_tools_do_what_their_descriptions_say(house):
    """The steering half of the loop through MCP, held to what the tools tell an agent, as its
    client lists them: `cancel_job` cancels a queued job and stops a running one (settled for
    what it ran, in the words it names), and is refused (409) only once the job has ended;
    `cancel_sweep` stops the rest. A session of its own (each MCP call is three HTTP requests
    against the session's calls a minute); its cap runs one trial at a time, so one queues."""
    from tests.agents.mcp_client import call_tool, tools

    session = "acme/agents/agent-mcp"
    granted = _cli(house["env"], "agent", "grant", session)
    assert granted.returncode == 0, granted.stderr
    token, ledger, url = granted.stdout.strip(), house["ledger"], house["gateway"].base + "/mcp"
    described = {tool.name: tool.description for tool in tools(url, token)}
    claims = described["cancel_job"]
    for claim in (
        "queued or running",
        "A queued job is cancelled (state `cancelled`, nothing spent)",
        "running one is stopped (state `stopping`",
        "settled for what it ran, outcome `cancelled`",
        f"reason `{STOPPED_BY_AGENT}`",
        "409 once it has ended",
    ):
        assert claim in claims, (claim, claims)
    assert (
        "its queued trials are cancelled and its running ones stopped"
        in (described["cancel_sweep"])
    )

    def tool(tool_name: str, **arguments: object) -> dict:
        error, content = call_tool(url, token, tool_name, arguments)
        assert not error, content
        return json.loads(content[0].text)

    def refused(tool_name: str, **arguments: object) -> str:
        error, content = call_tool(url, token, tool_name, arguments)
        assert error, content
        return content[0].text

    run = tool("start_sweep", spec=_train([0.01, 0.02, 0.03], steps=200, pause=0.3))["run_id"]
    job = _running_job(house, session, run)
    queued = wait_for(
        lambda: [j for j in ledger.views.jobs(session, flow_run_id=run) if j["state"] == "queued"],
        120,
        "a queued trial",
    )[0]
    assert tool("cancel_job", job_id=queued["id"]) == {"job_id": queued["id"], "state": "cancelled"}
    row = ledger.views.job(queued["id"])
    assert (row["state"], row["reason"], row["actual_micro"]) == ("cancelled", STOPPED_BY_AGENT, 0)
    assert refused("cancel_job", job_id=queued["id"]).startswith("409: ")

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # its learning curve has begun
        view = tool("get_sweep", run_id=run, wait_s=10)
        mine = [t for t in view["trials"] if t["job_id"] == job["id"]]
        if mine and mine[0]["records"] >= 2:
            break
    assert tool("cancel_job", job_id=job["id"]) == {"job_id": job["id"], "state": "stopping"}
    settled = wait_for(
        lambda: (row := ledger.views.job(job["id"]))["state"] == "settled" and row, 60, "the stop"
    )
    assert settled["outcome"] == "cancelled" and settled["reason"] == STOPPED_BY_AGENT
    assert 0 < settled["actual_micro"] < settled["reserved_micro"] / 2, settled
    assert refused("cancel_job", job_id=job["id"]) == (
        f"409: job_id: job {job['id'][:8]} is settled: it has ended"
    )
    cancelled = tool("cancel_sweep", run_id=run)
    assert cancelled["run_id"] == run
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not _ended(view):
        view = tool("get_sweep", run_id=run, wait_s=10)
    assert _ended(view) and view["cancelled"], view
    assert all(j["state"] in ("settled", "cancelled") for j in ledger.views.jobs(session))


def test_specs_beyond_the_limits_are_refused_through_mcp_as_through_rest(house):
    from tests.agents.mcp_client import call_tool

    session = "acme/agents/agent-mcp-bad"
    granted = _cli(house["env"], "agent", "grant", session)
    token, ledger = granted.stdout.strip(), house["ledger"]
    before = (len(ledger.views.jobs()), len(_admin(house, "/flow_runs/filter", {})))
    for attack, (spec, field) in REFUSED.items():
        error, content = call_tool(
            house["gateway"].base + "/mcp", token, "start_sweep", {"spec": spec}
        )
        assert error, (attack, content)
        if isinstance(spec, dict):  # a list is refused by the tool's own schema
            text = content[0].text
            assert text.startswith("422: ") and field in text and "\n" not in text, (attack, text)
    assert (len(ledger.views.jobs()), len(_admin(house, "/flow_runs/filter", {}))) == before


def test_guessing_tokens_is_rate_limited(house):
    """Last in this module: it locks this client's bad token out for a minute. One client's
    storm of one bad (or stale) token locks out that client, not the agents behind the same
    address; guessing many tokens meets the address's own cap (tests/agents/test_hardening.py)."""
    gw = house["gateway"]
    codes = [gw.call("GET", "/v1/status", "gpub_guessing-the-same")[0] for i in range(15)]
    assert codes[0] == 401 and codes[-1] == 429
    assert gw.call("GET", "/v1/status", house["tokens"][SESSION])[0] == 200
