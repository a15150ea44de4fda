"""The agent gateway: the one door agents have (`prefect-gpu-budget agents serve`).

An agent holds its token and this gateway's URL, nothing else. The token travels in an
`Authorization: Bearer` header and is checked against the ledger's grants on every call; the
gateway, a trusted client of a Prefect API that agents cannot reach (closed with
`PREFECT_SERVER_API_AUTH_STRING`), starts `agent-sweep/agents` with the agent's session and its
grant's id, never the token. Another session's run or job is a 404, exactly like one that does
not exist; a bad spec is a 422 whose one-line reason names the field; too many failed tokens
from one client, too many calls, or more sweeps than the team's limits allow is a 429.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict, deque
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import Body, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from prefect_gpu_budget.admission.ledger import FINAL, Ledger, open_ledger
from prefect_gpu_budget.flows.agent import agent_spec, cancel_own_job, limits_for
from prefect_gpu_budget.job import one_line
from prefect_gpu_budget.settings import ledger_url
from prefect_gpu_budget.units import BudgetInputError, micro_to_usd, redact_urls

DEPLOYMENT = "agent-sweep/agents"
SESSION_TAG = "gpu-budget-session:"
MAX_BODY_BYTES = 64 * 1024
"""Largest request body: a sweep spec is a few hundred bytes; nothing big is parsed."""
AUTH_FAILURES = (10, 60.0)
"""At most this many bad tokens per client address per window (s); then 429 until it passes."""
CALLS = (120, 60.0)
"""At most this many calls per grant per window (s)."""
ACTIVE_RUN_STATES = ["SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"]


class Window:
    """Events per key in a sliding window: `hit` records one and says whether it is one too
    many; `full` only asks. Keys with nothing in the window are forgotten."""

    def __init__(self, most: int, per_s: float) -> None:
        self.most, self.per_s = most, per_s
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _live(self, key: str, now: float) -> int:
        seen = self._seen.get(key)
        while seen and seen[0] <= now - self.per_s:
            seen.popleft()
        if not seen:
            self._seen.pop(key, None)
            return 0
        return len(seen)

    def full(self, key: str) -> bool:
        with self._lock:
            return self._live(key, time.monotonic()) >= self.most

    def hit(self, key: str) -> bool:
        with self._lock:
            now = time.monotonic()
            count = self._live(key, now) + 1
            self._seen.setdefault(key, deque()).append(now)
            return count > self.most


def _refuse(status: int, detail: str, **headers: str) -> HTTPException:
    return HTTPException(status_code=status, detail=detail, headers=headers or None)


def create_app(url: str | None = None, deployment: str = DEPLOYMENT) -> FastAPI:
    """The gateway over the ledger at `url` (default: the configured one) and the Prefect API
    of this process's settings (`PREFECT_API_URL`, `PREFECT_API_AUTH_STRING`)."""
    ledger: Ledger = open_ledger(ledger_url(url))
    failures, calls = Window(*AUTH_FAILURES), Window(*CALLS)
    session_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI's lifespan protocol
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            app.state.prefect = client
            yield

    app = FastAPI(
        title="prefect-gpu-budget agent gateway",
        version="1",
        lifespan=lifespan,
        description="Sweeps, their trials and spend, and cancellation, for one agent session "
        "per token (`Authorization: Bearer gpub_...`).",
    )

    @app.middleware("http")
    async def bounded_body(request: Request, call_next):  # noqa: ANN001, ANN202
        size = request.headers.get("content-length")
        if size is None and "transfer-encoding" in request.headers:
            return JSONResponse({"detail": "a body needs a Content-Length"}, status_code=411)
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            return JSONResponse(
                {"detail": f"body: at most {MAX_BODY_BYTES} bytes"}, status_code=413
            )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        return JSONResponse({"detail": f"{where}: {err.get('msg', 'invalid')}"}, status_code=422)

    @app.exception_handler(httpx.HTTPError)
    async def prefect_down(_: Request, exc: httpx.HTTPError) -> JSONResponse:
        return JSONResponse({"detail": "the Prefect API is unavailable"}, status_code=503)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:  # never a traceback or a URL
        return JSONResponse({"detail": f"internal error ({type(exc).__name__})"}, status_code=500)

    def session(request: Request) -> tuple[str, str]:
        """The caller's (session, grant) from its bearer token; 401 or 429 otherwise."""
        client = request.client.host if request.client else "?"
        if failures.full(client):
            raise _refuse(
                429, "too many bad tokens from this address; wait", **{"Retry-After": "60"}
            )
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        try:
            if scheme.lower() != "bearer" or not token.strip():
                raise BudgetInputError("authorization", "a bearer token is required")
            scope, grant = ledger.agent_grant(token.strip())
        except BudgetInputError:
            failures.hit(client)
            raise _refuse(
                401, "unknown or revoked token", **{"WWW-Authenticate": "Bearer"}
            ) from None
        if calls.hit(grant):
            raise _refuse(429, "too many calls for this session; wait", **{"Retry-After": "60"})
        return scope, grant

    def prefect(request: Request) -> Any:
        return request.app.state.prefect

    def active_sweeps(client: Any, scope: str, deployment_id: uuid.UUID, most: int) -> int:
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )

        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[SESSION_TAG + scope]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=ACTIVE_RUN_STATES)),
            ),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            limit=most + 1,
        )
        return len(runs)

    @app.post("/v1/sweeps", status_code=201)
    def start_sweep(
        request: Request,
        spec: dict[str, Any] = Body(..., description="A sweep spec, as `gpu_sweep` takes it."),
        caller: tuple[str, str] = Depends(session),
    ) -> dict[str, str]:
        """Start a sweep in the caller's session. 422 names the field a spec breaks; 429 when
        the session runs as many sweeps as its team's agents may."""
        scope, grant = caller
        limits = limits_for(ledger, scope)
        try:
            checked = agent_spec(spec, scope, limits, ledger.priority_values(scope))
        except (BudgetInputError, ValidationError, ValueError) as exc:
            raise _refuse(422, one_line(exc)) from None
        from prefect.exceptions import ObjectNotFound

        client = prefect(request)
        try:
            target = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise _refuse(503, f"{deployment} is not deployed: is its worker serving?") from None
        with session_locks[scope]:  # one start at a time: the count holds
            running = active_sweeps(client, scope, target.id, limits.max_sweeps)
            if running >= limits.max_sweeps:
                raise _refuse(
                    429,
                    f"{scope} runs {running} sweeps; its agents may run at most "
                    f"{limits.max_sweeps} at once",
                )
            run = client.create_flow_run_from_deployment(
                target.id,
                parameters={
                    "spec": checked.model_dump(mode="json"),
                    "session": scope,
                    "grant": grant,
                },
                tags=[SESSION_TAG + scope],
            )
        return {"run_id": str(run.id), "name": run.name}

    def own_run(client: Any, run_id: str, scope: str) -> Any:
        """The flow run if it is this session's agent sweep; 404 alike for absent and others'."""
        from prefect.exceptions import ObjectNotFound

        try:
            run = client.read_flow_run(uuid.UUID(run_id))
        except (ValueError, ObjectNotFound):
            run = None
        if run is None or (run.parameters or {}).get("session") != scope:
            raise _refuse(404, f"no sweep {run_id[:36]!r} in {scope}")
        return run

    @app.get("/v1/sweeps/{run_id}")
    def sweep(
        request: Request, run_id: str, caller: tuple[str, str] = Depends(session)
    ) -> dict[str, Any]:
        """A sweep of the caller's session: its state, its trials and what they cost."""
        scope, _ = caller
        run = own_run(prefect(request), run_id, scope)
        trials = [_trial(row) for row in ledger.jobs(scope, flow_run_id=str(run.id))]
        state = run.state
        return {
            "run_id": str(run.id),
            "name": run.name,
            "state": state.name if state else "Unknown",
            "message": redact_urls(state.message or "") if state else "",
            "trials": trials,
            "spent_usd": sum(t["cost_usd"] for t in trials),
        }

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str, caller: tuple[str, str] = Depends(session)) -> dict[str, str]:
        """Cancel one of the caller's queued jobs (409 once it is no longer queued)."""
        scope, _ = caller
        try:
            cancel_own_job(ledger, job_id, scope)
        except LookupError:
            raise _refuse(404, f"no job {job_id[:36]!r} in {scope}") from None
        except BudgetInputError as exc:
            raise _refuse(409, str(exc)) from None
        return {"job_id": job_id, "state": "cancelled"}

    @app.get("/v1/status")
    def status(caller: tuple[str, str] = Depends(session)) -> dict[str, Any]:
        """The caller's session: its budget and spend, and its jobs not yet ended."""
        scope, _ = caller
        budgets = [
            {
                key.removesuffix("_micro") + "_usd" if key.endswith("_micro") else key: (
                    micro_to_usd(value) if key.endswith("_micro") and value is not None else value
                )
                for key, value in row.items()
            }
            for row in ledger.status(scope)
            if row["scope"] == scope
        ]
        for budget in budgets:  # `running_rate_usd` is deprecated: `status --json`'s name
            budget["running_rate_usd_per_hour"] = budget["running_rate_usd"]
        if not budgets:  # no job yet: the team's template is what its first job will get
            team = scope.rsplit("/", 1)[0]
            budgets = [
                {
                    "scope": scope,
                    "from_template": team,
                    "hourly_cap_usd": None
                    if rule.hourly_cap_cents is None
                    else rule.hourly_cap_cents / 100,
                    "period_budget_usd": micro_to_usd(rule.period_budget_micro)
                    if rule.period_budget_micro is not None
                    else None,
                    "period": rule.period,
                }
                for rule in ledger.session_templates()
                if rule.scope == team
            ]
        live = [_trial(r) for r in ledger.jobs(scope, limit=500) if r["state"] not in FINAL]
        return {"session": scope, "budget": budgets[0] if budgets else None, "jobs": live}

    return app


def _trial(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "job_id": row["id"],
        "name": row["name"],
        "state": row["state"],
        "reason": redact_urls(row["reason"] or ""),
        "cost_usd": micro_to_usd(row["actual_micro"] or 0),
        "requested_at": row["requested_at"],
        "started_at": row["started_at"],
        "ended_at": row["ended_at"],
    }


def serve(host: str = "127.0.0.1", port: int = 8080, url: str | None = None) -> None:
    """Run the gateway until stopped."""
    import uvicorn

    uvicorn.run(create_app(url), host=host, port=port, log_level="info")
