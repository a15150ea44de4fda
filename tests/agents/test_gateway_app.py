"""The gateway app as `create_app` assembles it from `agents.routes`' routers, in process: each
operation of `agents.operations` is one route, described as the table says, and each app reaches
its own `Door` (the routers are shared module objects, the door is the app's).

Over SQLite ledgers with FastAPI's TestClient and the Prefect API pointed at a closed port, as
tests/agents/test_hardening.py does; no operation here needs Prefect.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.agents.gateway import create_app
from prefect_gpu_budget.agents.operations import OPERATIONS

SESSION = "acme/agents/agent-1"
DOWN_API = "http://127.0.0.1:9/api"


def _ledger(path: Path) -> Ledger:
    led = Ledger(f"sqlite:///{path}")
    led.config.set_session_template(BudgetRule("acme/agents", hourly_cap_cents=360))
    return led


@pytest.fixture
def ledgers(tmp_path: Path) -> Iterator[tuple[Ledger, Ledger]]:
    first, second = _ledger(tmp_path / "first.db"), _ledger(tmp_path / "second.db")
    yield first, second
    first.db.dispose()
    second.db.dispose()


def test_every_operation_is_one_route_described_as_its_operation(tmp_path: Path) -> None:
    spec = create_app(f"sqlite:///{tmp_path / 'ledger.db'}").openapi()
    routes = {(path, method.upper()) for path, item in spec["paths"].items() for method in item}
    assert routes == {(op.route, op.method) for op in OPERATIONS}
    for op in OPERATIONS:
        route = spec["paths"][op.route][op.method.lower()]
        assert (route["summary"], route["description"]) == (op.summary, op.description), op.tool
        assert route["operationId"] == op.tool
    assert "201" in spec["paths"]["/v1/sweeps"]["post"]["responses"]


def test_each_app_answers_from_its_own_door(ledgers: tuple[Ledger, Ledger]) -> None:
    granted, other = ledgers
    token = {"Authorization": f"Bearer {granted.grants.grant_agent(SESSION)}"}
    down = {PREFECT_API_URL: DOWN_API, PREFECT_CLIENT_MAX_RETRIES: 0}
    with temporary_settings(updates=down), ExitStack() as stack:
        apps = [create_app(led.url) for led in (granted, other)]
        assert apps[0].state.door is not apps[1].state.door
        mine, theirs = (stack.enter_context(TestClient(app)) for app in apps)
        answer = mine.get("/v1/status", headers=token)
        assert answer.status_code == 200, answer.text
        assert answer.json()["session"] == SESSION
        refused = theirs.get("/v1/status", headers=token)
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == "Bearer"
        wrong = mine.get("/v1/jobs/j/cancel", headers=token)
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
