"""Two gateways behind one load balancer keep one set of limits (issue 40, item 4).

Two real `prefect-gpu-budget agents serve` processes over one PostgreSQL ledger, one Prefect
server and one Redis (PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL; the run's own `redis-server`, else
a database number of the shared one: tests/hosts/cluster.py's `Redis`). The client alternates
between them as a round-robin balancer would; each part of the test comes from an address of
its own (`X-Forwarded-For`, believed from loopback, the balancer here), so the parts do not
share their counts. Bad tokens, calls, long polls and a session's sweeps are limited across both
gateways, as they are within one; and a sweep is read, waited on and cancelled through whichever
gateway answers.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from prefect_gpu_budget.admission.admin_settings import AgentLimits
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.agents.callers import AUTH_FAILURES, AUTH_FAILURES_PER_ADDRESS, CALLS
from prefect_gpu_budget.agents.door import LONG_POLLS
from prefect_gpu_budget.agents.throttle import NAMESPACE
from tests.conftest import PG_URL
from tests.hosts.cluster import Redis
from tests.support.gateway import GatewayStack, bearer, stale_token
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, wait_for
from tests.support.prefect_server import http as prefect_http

SESSION, OTHER = "acme/agents/agent-1", "acme/agents/agent-2"
WAIT_S = 6
"""How long the long polls that get a slot wait (nothing in their sweep changes)."""


def _get(base: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any], str]:
    """Status, JSON body and Retry-After of one GET."""
    request = urllib.request.Request(base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            code, text, retry = response.status, response.read(), ""
    except urllib.error.HTTPError as exc:
        code, text, retry = exc.code, exc.read(), exc.headers.get("Retry-After", "")
    return code, json.loads(text or b"{}"), retry


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("gateways")
    redis = Redis(tmp, "share")
    with fresh_database(PG_URL) as url:
        ledger = Ledger(url)
        server = None
        try:
            redis.open()
            ledger.config.set_session_template(BudgetRule("acme/agents", hourly_cap_cents=360))
            tokens = {s: ledger.grants.grant_agent(s) for s in (SESSION, OTHER)}
            server = PrefectServer(tmp / "home").start()
            flow = prefect_http(f"{server.api}/flows/", {"name": "agent-sweep"})
            run = prefect_http(  # a sweep of SESSION's that stays Running: long polls wait on it
                f"{server.api}/flow_runs/",
                {
                    "flow_id": flow["id"],
                    "parameters": {"session": SESSION},
                    "state": {"type": "RUNNING", "name": "Running"},
                },
            )
            from prefect_gpu_budget.pricing.catalog import set_local_price

            prices = set_local_price("box", "3.6", path=tmp / "prices.csv")
            env = server.client_env(
                PREFECT_GPU_BUDGET_LEDGER_URL=url,
                PREFECT_GPU_BUDGET_PRICES=str(prices),  # what a start's spec check reads
                PREFECT_GPU_BUDGET_AGENT_USER="nobody",
                PREFECT_GPU_BUDGET_LOCAL_MACHINE="local:box",
                PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL=(
                    f"redis://{redis.host}:{redis.port}/{redis.messaging_db}"
                ),
                PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES="127.0.0.1",
            )
            with GatewayStack(env, tmp, serve=False, names=("gateway-a", "gateway-b")) as stack:
                yield {
                    "bases": stack.bases,
                    "tokens": tokens,
                    "run_id": run["id"],
                    "flow_id": flow["id"],
                    "api": server.api,
                    "tmp": tmp,
                    "redis": redis,
                    "ledger": ledger,
                }
        finally:
            if server is not None:
                server.stop()
            redis.close()
            ledger.db.dispose()


def _from(address: str, **headers: str) -> dict[str, str]:
    return {"X-Forwarded-For": address, **headers}


def test_one_clients_bad_token_is_locked_out_across_both_gateways(gateways):
    a, b = gateways["bases"]
    stale = stale_token()
    answers = [
        _get((a, b)[n % 2], "/v1/status", _from("198.51.100.1", **bearer(stale)))
        for n in range(AUTH_FAILURES[0] + 4)
    ]
    codes = [code for code, _, _ in answers]
    assert codes == [401] * AUTH_FAILURES[0] + [429] * 4, codes  # 5 on each, not 10 on each
    assert all(1 <= int(retry) <= 60 for _, _, retry in answers[AUTH_FAILURES[0] :])
    for base in (a, b):  # the agent behind the same address is served by either
        mine = _get(base, "/v1/status", _from("198.51.100.1", **bearer(gateways["tokens"][OTHER])))
        assert mine[0] == 200 and mine[1]["session"] == OTHER


def test_an_addresses_bad_tokens_are_capped_across_both_gateways(gateways):
    a, b = gateways["bases"]
    most = AUTH_FAILURES_PER_ADDRESS[0]
    codes = [
        _get((a, b)[n % 2], "/v1/status", _from("198.51.100.2", **bearer(stale_token())))[0]
        for n in range(most)
    ]
    assert set(codes) == {401}, codes
    for base in (a, b):
        code, body, retry = _get(base, "/v1/status", _from("198.51.100.2", **bearer(stale_token())))
        assert code == 429 and body["detail"] == "too many bad tokens from this address; wait"
        assert 1 <= int(retry) <= 60
        assert _get(base, "/v1/status", _from("198.51.100.3", **bearer(stale_token())))[0] == 401
        valid = bearer(gateways["tokens"][OTHER])
        assert _get(base, "/v1/status", _from("198.51.100.2", **valid))[0] == 200


def test_long_polls_past_the_grants_cap_across_both_gateways_answer_at_once(gateways):
    a, b = gateways["bases"]
    path = f"/v1/sweeps/{gateways['run_id']}?wait={WAIT_S}"
    mine = _from("198.51.100.4", **bearer(gateways["tokens"][SESSION]))
    redis = gateways["redis"]
    import redis as redis_py

    client = redis_py.Redis(redis.host, redis.port, db=redis.messaging_db)
    held_key = f"{NAMESPACE}{{long-polls}}:all"
    answers: dict[int, tuple[int, float]] = {}

    def poll(n: int, base: str) -> None:
        began = time.monotonic()
        code, body, _ = _get(base, path, mine)
        assert code == 200 and body["state"] == "Running", body
        answers[n] = (code, time.monotonic() - began)

    waiting = [threading.Thread(target=poll, args=(n, base)) for n, base in enumerate((a, b))]
    for thread in waiting:
        thread.start()
    wait_for(lambda: client.zcard(held_key) == LONG_POLLS[0], 30, "both long polls held")
    for n, base in ((2, a), (3, b)):  # the grant's third and fourth, one on each gateway
        poll(n, base)
        assert answers[n][1] < WAIT_S / 2, answers  # answered at once: no slot anywhere
    for thread in waiting:
        thread.join(timeout=WAIT_S * 4)
    assert all(answers[n][1] >= WAIT_S - 1 for n in (0, 1)), answers  # these two waited
    assert client.zcard(held_key) == 0  # given back on both gateways
    client.close()


def test_a_grants_calls_are_counted_across_both_gateways(gateways):
    a, b = gateways["bases"]
    token = gateways["ledger"].grants.grant_agent("acme/agents/agent-3")
    theirs = _from("198.51.100.5", **bearer(token))
    codes = [_get((a, b)[n % 2], "/v1/status", theirs)[0] for n in range(CALLS[0])]
    assert set(codes) == {200}, codes
    for base in (a, b):
        code, body, retry = _get(base, "/v1/status", theirs)
        assert code == 429 and body["detail"] == "too many calls for this session; wait", body
        assert 1 <= int(retry) <= CALLS[1]


def test_a_sweep_is_waited_on_through_one_gateway_and_cancelled_through_the_other(gateways):
    """A gateway holds nothing of a sweep's own: a long poll on one sees a cancel asked through
    the other's MCP tool, and REST on either reads the same state."""
    from tests.agents.mcp_client import call_tool

    a, b = gateways["bases"]
    token = gateways["tokens"][OTHER]
    run = prefect_http(
        f"{gateways['api']}/flow_runs/",
        {
            "flow_id": gateways["flow_id"],
            "parameters": {"session": OTHER},
            "state": {"type": "RUNNING", "name": "Running"},
        },
    )
    path = f"/v1/sweeps/{run['id']}"
    mine = _from("198.51.100.6", **bearer(token))
    answered: dict[str, Any] = {}

    def long_poll() -> None:
        began = time.monotonic()
        answered["view"] = _get(a, f"{path}?wait=30", mine)
        answered["took"] = time.monotonic() - began

    import redis as redis_py

    redis = gateways["redis"]
    client = redis_py.Redis(redis.host, redis.port, db=redis.messaging_db)
    waiting = threading.Thread(target=long_poll)
    waiting.start()
    held_key = f"{NAMESPACE}{{long-polls}}:all"
    wait_for(lambda: client.zcard(held_key) == 1, 30, "the poll held on gateway a")
    client.close()
    error, content = call_tool(f"{b}/mcp", token, "cancel_sweep", {"run_id": run["id"]})
    assert not error, content
    assert json.loads(content[0].text)["run_id"] == run["id"]
    waiting.join(timeout=60)
    code, view, _ = answered["view"]
    assert code == 200 and view["state"] == "Cancelling", view
    assert answered["took"] < 25, answered  # woken by the change, not by its wait running out
    for base in (a, b):
        code, view, _ = _get(base, path, mine)
        assert code == 200 and view["state"] == "Cancelling", view


def _served(api: str) -> None:
    """The agent deployment, as a worker serving it leaves it: there, and polled just now."""
    flow = prefect_http(f"{api}/flows/filter", {"flows": {"name": {"any_": ["agent-sweep"]}}})[0]
    deployment = prefect_http(f"{api}/deployments/", {"name": "agents", "flow_id": flow["id"]})
    prefect_http(
        f"{api}/deployments/get_scheduled_flow_runs", {"deployment_ids": [deployment["id"]]}
    )
    wait_for(
        lambda: prefect_http(f"{api}/deployments/{deployment['id']}")["last_polled"],
        60,
        "the deployment polled",
    )


def test_a_sessions_sweeps_past_its_limit_are_refused_across_both_gateways(gateways):
    """Starts of one session's sweeps race on both gateways: the team's max_sweeps (1) holds
    across them (each gateway counted and started on its own: one each, two in all)."""
    a, b = gateways["bases"]
    ledger = gateways["ledger"]
    ledger.config.set_session_template(BudgetRule("acme/one", hourly_cap_cents=360))
    ledger.grants.set_agent_limits("acme/one", AgentLimits(team="acme/one", max_sweeps=1).stored())
    token = ledger.grants.grant_agent("acme/one/agent-1")
    _served(gateways["api"])
    spec = {
        "name": "race",
        "job": {"instance_type": "local:box", "max_runtime": "1m"},
        "command": ["true"],
        "grid": {"lr": [1]},
    }
    headers = _from("198.51.100.7", **bearer(token), **{"Content-Type": "application/json"})
    go = threading.Barrier(6)
    codes: list[int] = []

    def start(base: str) -> None:
        request = urllib.request.Request(
            base + "/v1/sweeps", data=json.dumps(spec).encode(), headers=headers, method="POST"
        )
        go.wait()
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                codes.append(response.status)
        except urllib.error.HTTPError as exc:
            codes.append(exc.code)
            assert exc.code == 429, exc.read()

    threads = [threading.Thread(target=start, args=((a, b)[n % 2],)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert sorted(codes) == [201] + [429] * 5, codes
