"""The gateway's REST routes (`agents.gateway` mounts them), grouped by what they serve: a
session's sweeps, its jobs, and its budget.

Each route is one operation of `agents.operations`, from which it takes its path, method,
OpenAPI summary and description and operation id (`operation`). A route reaches the gateway's
`Door` through the app it serves (`app.state.door`, set by `create_app`), so the routers hold
no state and any number of apps can include them; `caller` checks the request's bearer token
before a route runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import PlainTextResponse, Response

from prefect_gpu_budget.agents.callers import Caller
from prefect_gpu_budget.agents.door import MAX_LONG_POLL_S, MAX_PAGE, Door
from prefect_gpu_budget.agents.operations import BY_TOOL, ResultsFormat

SPEC = Body(..., description="A sweep spec, as `gpu_sweep` takes it.")


async def the_door(request: Request) -> Door:
    """The `Door` of the app serving `request`."""
    return request.app.state.door


def caller(request: Request, door: Annotated[Door, Depends(the_door)]) -> Caller:
    """Who calls: the grant of the request's bearer token, from the client address as
    `gateway.ClientAddress` set it (`Door.caller` refuses a bad token, or too many calls)."""
    address = request.client.host if request.client else "?"
    return door.caller(request.headers.get("authorization"), address)


TheDoor = Annotated[Door, Depends(the_door)]
Who = Annotated[Caller, Depends(caller)]


def operation(
    router: APIRouter, tool: str, **options: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The route on `router` of the operation `tool` (`agents.operations`), with its summary
    and description in OpenAPI and the tool's name as its operation id."""
    op = BY_TOOL[tool]
    return router.api_route(
        op.route,
        methods=[op.method],
        summary=op.summary,
        description=op.description,
        operation_id=op.tool,
        **options,
    )


sweeps = APIRouter()
"""A session's sweeps: start one, follow it, read its trials, results, plots and summary, stop
it."""


@operation(sweeps, "start_sweep", status_code=201)
def start_sweep(door: TheDoor, who: Who, spec: dict[str, Any] = SPEC) -> dict[str, str]:
    return door.start_sweep(who, spec)


@operation(sweeps, "get_sweep")
def sweep(
    door: TheDoor,
    who: Who,
    run_id: str,
    wait: float = Query(
        0,
        ge=0,
        le=MAX_LONG_POLL_S,
        description="Long poll: answer once anything changed, "
        f"or after this many seconds (at most {MAX_LONG_POLL_S:.0f}).",
    ),
) -> dict[str, Any]:
    return door.sweep(who, run_id, wait)


@operation(sweeps, "get_trial_metrics")
def trial_metrics(
    door: TheDoor,
    who: Who,
    run_id: str,
    trial: int,
    offset: int = Query(0, ge=0),
    limit: int = Query(500, ge=1, le=MAX_PAGE),
) -> dict[str, Any]:
    return door.trial_metrics(who, run_id, trial, offset, limit)


@operation(sweeps, "get_results", response_model=None)
def results(
    request: Request,
    door: TheDoor,
    who: Who,
    run_id: str,
    format: ResultsFormat | None = Query(
        None, description="json or csv; without it, CSV when `Accept` names text/csv."
    ),
) -> Any:
    if format == "csv" or (format is None and "text/csv" in request.headers.get("accept", "")):
        return PlainTextResponse(door.results_csv(who, run_id), media_type="text/csv")
    return door.results(who, run_id)


@operation(sweeps, "list_plots")
def plots(door: TheDoor, who: Who, run_id: str) -> list[str]:
    return door.plots(who, run_id)


@operation(sweeps, "get_plot", response_class=Response)
def plot(door: TheDoor, who: Who, run_id: str, name: str) -> Response:
    return Response(door.plot(who, run_id, name), media_type="image/png")


@operation(sweeps, "get_summary", response_class=PlainTextResponse)
def summary(door: TheDoor, who: Who, run_id: str) -> PlainTextResponse:
    return PlainTextResponse(door.summary(who, run_id), media_type="text/markdown")


@operation(sweeps, "cancel_sweep")
def cancel_sweep(door: TheDoor, who: Who, run_id: str) -> dict[str, Any]:
    return door.cancel_sweep(who, run_id)


jobs = APIRouter()
"""A session's jobs (a sweep's trials, one by one): stop one."""


@operation(jobs, "cancel_job")
def cancel(door: TheDoor, who: Who, job_id: str) -> dict[str, str]:
    return door.cancel_job(who, job_id)


budget = APIRouter()
"""What a session may spend: forecast a sweep, quote a machine, its budget and spend."""


@operation(budget, "forecast_sweep")
def forecast(door: TheDoor, who: Who, spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    return door.forecast(who, spec)


@operation(budget, "quote")
def quote(
    door: TheDoor,
    who: Who,
    instance_type: str,
    nodes: int = 1,
    hours: float = 1.0,
    provisioning: str = "on-demand",
) -> dict[str, Any]:
    return door.quote(instance_type, nodes, hours, provisioning)


@operation(budget, "place")
def place(
    door: TheDoor,
    who: Who,
    accelerators: str,
    nodes: int = 1,
    hours: float = 1.0,
    deadline_h: float | None = None,
    max_wait_h: float | None = None,
    resumable: bool = False,
) -> dict[str, Any]:
    return door.place(who, accelerators, nodes, hours, deadline_h, max_wait_h, resumable)


@operation(budget, "get_status")
def status(door: TheDoor, who: Who) -> dict[str, Any]:
    return door.status(who)


ROUTERS = (sweeps, jobs, budget)
"""Every REST route of the gateway, in the order OpenAPI lists them."""
