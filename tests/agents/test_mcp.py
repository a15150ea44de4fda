"""The MCP door over a fake `Door`, served by uvicorn and driven by the MCP SDK's own client."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from prefect_gpu_budget.agents.callers import Caller, Refused
from prefect_gpu_budget.agents.operations import OPERATIONS
from tests.agents.mcp_client import (
    HTTPRefused,
    _with_session,
    call_tool,
    list_tools,
    serving_mcp,
    tools,
)

TOOLS = {
    "start_sweep",
    "get_sweep",
    "get_trial_metrics",
    "cancel_job",
    "cancel_sweep",
    "forecast_sweep",
    "quote",
    "place",
    "get_status",
    "get_results",
    "list_plots",
    "get_plot",
    "get_summary",
}
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00fake-png" * 8
TOKENS = {"gpub_alice": Caller("team/alice", "g1"), "gpub_bob": Caller("team/bob", "g2")}
BUSY = "gpub_busy"
RUN = "run-1"  # alice's


class FakeDoor:
    """The `Door` interface over canned data; records each operation it runs."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str, tuple[Any, ...]]] = []
        self._lock = threading.Lock()

    def _ran(self, op: str, caller: Caller | None, *args: Any) -> None:
        with self._lock:
            self.ran.append((op, caller.session if caller else "", args))

    def caller(self, authorization: str | None, address: str) -> Caller:
        scheme, _, token = (authorization or "").partition(" ")
        if token == BUSY:
            raise Refused(429, "too many calls for this session; wait", {"Retry-After": "60"})
        if scheme.lower() != "bearer" or token not in TOKENS:
            raise Refused(401, "unknown or revoked token", {"WWW-Authenticate": "Bearer"})
        return TOKENS[token]

    def _own(self, caller: Caller, run_id: str) -> None:
        if run_id != RUN or caller.session != "team/alice":
            raise Refused(404, f"no sweep {run_id[:36]!r}")

    def start_sweep(self, caller: Caller, spec: dict) -> dict:
        self._ran("start_sweep", caller, spec)
        if "trials" not in spec:
            raise Refused(422, "trials: field required")
        return {"run_id": RUN, "name": "brave-otter"}

    def sweep(self, caller: Caller, run_id: str, wait_s: float = 0) -> dict:
        self._ran("sweep", caller, run_id, wait_s)
        self._own(caller, run_id)
        return {
            "run_id": run_id,
            "state": "Running",
            "message": "",
            "spent_usd": 1.5,
            "trials": [{"trial": 0, "state": "COMPLETED", "cost_usd": 1.5}],
            "best": {"trial": 0, "loss": 0.25},
        }

    def trial_metrics(
        self, caller: Caller, run_id: str, trial: int, offset: int = 0, limit: int = 500
    ) -> dict:
        self._ran("trial_metrics", caller, run_id, trial, offset, limit)
        self._own(caller, run_id)
        records = [{"step": i, "loss": 1 / (i + 1)} for i in range(5)][offset : offset + limit]
        return {"records": records, "next_offset": None}

    def results(self, caller: Caller, run_id: str) -> list[dict]:
        self._ran("results", caller, run_id)
        self._own(caller, run_id)
        return [{"trial": 0, "params": {"lr": 0.1}, "loss": 0.25}]

    def results_csv(self, caller: Caller, run_id: str) -> str:
        self._ran("results_csv", caller, run_id)
        self._own(caller, run_id)
        return "trial,lr,loss\n0,0.1,0.25\n"

    def plots(self, caller: Caller, run_id: str) -> list[str]:
        self._ran("plots", caller, run_id)
        self._own(caller, run_id)
        return ["metric_vs_params.png"]

    def plot(self, caller: Caller, run_id: str, name: str) -> bytes:
        self._ran("plot", caller, run_id, name)
        self._own(caller, run_id)
        if name != "metric_vs_params.png":
            raise Refused(404, f"no plot {name!r}")
        return PNG

    def summary(self, caller: Caller, run_id: str) -> str:
        self._ran("summary", caller, run_id)
        self._own(caller, run_id)
        return "# brave-otter\n\nbest: trial 0"

    def cancel_job(self, caller: Caller, job_id: str) -> dict:
        self._ran("cancel_job", caller, job_id)
        if job_id == "done":
            raise Refused(409, "job done is no longer queued")
        return {"job_id": job_id, "state": "cancelled"}

    def cancel_sweep(self, caller: Caller, run_id: str) -> dict:
        self._ran("cancel_sweep", caller, run_id)
        self._own(caller, run_id)
        return {"run_id": run_id, "state": "Cancelling"}

    def forecast(self, caller: Caller, spec: dict) -> dict:
        self._ran("forecast", caller, spec)
        if spec.get("boom"):
            raise RuntimeError("secret path and traceback material")
        return {"cost_usd": 12.0, "fits_budget": True}

    def quote(
        self,
        instance_type: str,
        nodes: int = 1,
        hours: float = 1.0,
        provisioning: str = "on-demand",
    ) -> dict:
        self._ran("quote", None, instance_type, nodes, hours, provisioning)
        return {"instance_type": instance_type, "usd": 4.0 * nodes * hours}

    def status(self, caller: Caller) -> dict:
        self._ran("status", caller)
        time.sleep(0.05)  # overlapping calls from two tokens must not trade callers
        return {"session": caller.session, "budget": None, "jobs": []}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeDoor]]:
    door = FakeDoor()
    with serving_mcp(door) as url:
        yield url, door


def _json(content: list) -> Any:
    assert len(content) == 1 and content[0].type == "text", content
    return json.loads(content[0].text)


def _error(url: str, token: str, name: str, arguments: dict) -> str:
    is_error, content = call_tool(url, token, name, arguments)
    assert is_error, content
    assert len(content) == 1 and content[0].type == "text"
    return content[0].text


def test_lists_exactly_the_tools(served: tuple[str, FakeDoor]) -> None:
    url, _ = served
    assert set(list_tools(url, "gpub_alice")) == TOOLS


def test_each_tool_is_described_as_its_operation_and_its_route(
    served: tuple[str, FakeDoor], tmp_path
) -> None:
    """One description per operation (`agents.operations`): the MCP tool's, as a client lists
    it, and the REST route's summary and description in OpenAPI."""
    from prefect_gpu_budget.agents.gateway import create_app

    url, _ = served
    listed = {tool.name: tool for tool in tools(url, "gpub_alice")}
    assert set(listed) == {op.tool for op in OPERATIONS} == TOOLS
    spec = create_app(f"sqlite:///{tmp_path / 'ledger.db'}").openapi()
    for op in OPERATIONS:
        assert listed[op.tool].description == op.description, op.tool
        route = spec["paths"][op.route][op.method.lower()]
        assert (route["summary"], route["description"]) == (op.summary, op.description), op.route
        assert route["operationId"] == op.tool
    described = {
        name: prop.get("description", "")
        for name, prop in listed["get_sweep"].input_schema["properties"].items()
    }
    assert "at most 30" in described["wait_s"]
    assert listed["get_results"].input_schema["properties"]["format"]["enum"] == ["json", "csv"]


def test_get_results_answers_csv_as_rest_does(served: tuple[str, FakeDoor]) -> None:
    url, door = served
    is_error, content = call_tool(
        url, "gpub_alice", "get_results", {"run_id": RUN, "format": "csv"}
    )
    assert not is_error and len(content) == 1 and content[0].type == "text", content
    assert content[0].text == "trial,lr,loss\n0,0.1,0.25\n"
    assert ("results_csv", "team/alice", (RUN,)) in door.ran
    is_error, content = call_tool(
        url, "gpub_alice", "get_results", {"run_id": RUN, "format": "json"}
    )
    assert _json(content) == {"results": [{"trial": 0, "params": {"lr": 0.1}, "loss": 0.25}]}
    assert call_tool(url, "gpub_alice", "get_results", {"run_id": RUN, "format": "xml"})[0]
    assert _error(url, "gpub_bob", "get_results", {"run_id": RUN, "format": "csv"}).startswith(
        "404: "
    )


def test_each_tool_acts_as_the_callers_session(served: tuple[str, FakeDoor]) -> None:
    url, door = served
    alice = "gpub_alice"
    calls: dict[str, tuple[dict, Any]] = {
        "start_sweep": ({"spec": {"trials": 2}}, {"run_id": RUN, "name": "brave-otter"}),
        "get_trial_metrics": (
            {"run_id": RUN, "trial": 0, "offset": 3, "limit": 10},
            {"records": [{"step": 3, "loss": 0.25}, {"step": 4, "loss": 0.2}], "next_offset": None},
        ),
        "get_results": (
            {"run_id": RUN},
            {"results": [{"trial": 0, "params": {"lr": 0.1}, "loss": 0.25}]},
        ),
        "list_plots": ({"run_id": RUN}, {"plots": ["metric_vs_params.png"]}),
        "cancel_job": ({"job_id": "j1"}, {"job_id": "j1", "state": "cancelled"}),
        "cancel_sweep": ({"run_id": RUN}, {"run_id": RUN, "state": "Cancelling"}),
        "forecast_sweep": ({"spec": {"trials": 2}}, {"cost_usd": 12.0, "fits_budget": True}),
        "quote": (
            {"instance_type": "p5.48xlarge", "nodes": 2, "hours": 1.5},
            {"instance_type": "p5.48xlarge", "usd": 12.0},
        ),
        "get_status": ({}, {"session": "team/alice", "budget": None, "jobs": []}),
    }
    for name, (arguments, expected) in calls.items():
        is_error, content = call_tool(url, alice, name, arguments)
        assert not is_error, (name, content)
        assert _json(content) == expected, name

    is_error, content = call_tool(url, alice, "get_sweep", {"run_id": RUN, "wait_s": 2.5})
    assert not is_error
    sweep = _json(content)
    assert sweep["state"] == "Running" and sweep["best"] == {"trial": 0, "loss": 0.25}

    is_error, content = call_tool(url, alice, "get_summary", {"run_id": RUN})
    assert not is_error and content[0].type == "text"
    assert content[0].text.startswith("# brave-otter")

    ran = door.ran
    assert ("sweep", "team/alice", (RUN, 2.5)) in ran
    assert ("trial_metrics", "team/alice", (RUN, 0, 3, 10)) in ran
    assert ("quote", "", ("p5.48xlarge", 2, 1.5, "on-demand")) in ran
    assert ("start_sweep", "team/alice", ({"trials": 2},)) in ran


def test_get_plot_is_png_image_content(served: tuple[str, FakeDoor]) -> None:
    url, _ = served
    is_error, content = call_tool(
        url, "gpub_alice", "get_plot", {"run_id": RUN, "name": "metric_vs_params.png"}
    )
    assert not is_error
    assert len(content) == 1 and content[0].type == "image"
    assert content[0].mime_type == "image/png"
    assert base64.b64decode(content[0].data) == PNG


def test_refused_is_a_tool_error_and_others_runs_read_as_absent(
    served: tuple[str, FakeDoor],
) -> None:
    url, _ = served
    absent = _error(url, "gpub_bob", "get_sweep", {"run_id": "nope"})
    others = _error(url, "gpub_bob", "get_sweep", {"run_id": RUN})
    assert absent == "404: no sweep 'nope'"
    assert others == "404: no sweep 'run-1'"  # bob's view of alice's run: as if absent
    assert _error(url, "gpub_alice", "get_sweep", {"run_id": "nope"}) == absent
    assert _error(url, "gpub_alice", "get_plot", {"run_id": RUN, "name": "x.png"}) == (
        "404: no plot 'x.png'"
    )
    assert _error(url, "gpub_alice", "start_sweep", {"spec": {}}) == "422: trials: field required"
    assert _error(url, "gpub_alice", "cancel_job", {"job_id": "done"}) == (
        "409: job done is no longer queued"
    )
    crash = _error(url, "gpub_alice", "forecast_sweep", {"spec": {"boom": True}})
    assert crash == "500: internal error (RuntimeError)"


def test_bad_or_missing_token_is_http_401_and_runs_nothing(
    served: tuple[str, FakeDoor],
) -> None:
    url, door = served
    before = len(door.ran)
    for token in ("gpub_wrong", ""):
        with pytest.raises(HTTPRefused) as refused:
            call_tool(url, token, "get_status", {})
        assert refused.value.status == 401
        assert refused.value.headers.get("www-authenticate") == "Bearer"
        with pytest.raises(HTTPRefused):
            list_tools(url, token)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "get_status"}}
    accept = {"Accept": "application/json, text/event-stream"}
    for headers in ({}, {"Authorization": "Bearer gpub_wrong"}, {"Authorization": "gpub_alice"}):
        response = httpx.post(url, json=body, headers={**accept, **headers})
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {"detail": "unknown or revoked token"}
    assert len(door.ran) == before


def test_stateless_endpoint_takes_only_post(served: tuple[str, FakeDoor]) -> None:
    url, _ = served
    alice = {"Authorization": "Bearer gpub_alice", "Accept": "text/event-stream"}
    for method in ("GET", "DELETE"):
        assert (
            httpx.request(method, url, headers={"Accept": "text/event-stream"}).status_code == 401
        )
        response = httpx.request(method, url, headers=alice, timeout=10)
        assert response.status_code == 405 and response.headers["allow"] == "POST"


def test_too_many_calls_is_http_429(served: tuple[str, FakeDoor]) -> None:
    url, door = served
    before = len(door.ran)
    with pytest.raises(HTTPRefused) as refused:
        call_tool(url, BUSY, "get_status", {})
    assert refused.value.status == 429 and refused.value.headers.get("retry-after") == "60"
    assert len(door.ran) == before


def test_concurrent_callers_keep_their_own_sessions(served: tuple[str, FakeDoor]) -> None:
    url, _ = served
    seen: list[tuple[str, str]] = []

    async def status_as(token: str) -> None:
        async def call(session: Any) -> None:
            result = await session.call_tool("get_status", {})
            seen.append((token, json.loads(result.content[0].text)["session"]))

        await _with_session(url, token, call)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(status_as, "gpub_alice")
                tg.start_soon(status_as, "gpub_bob")

    anyio.run(main)
    assert len(seen) == 8
    assert all(TOKENS[token].session == session for token, session in seen)
