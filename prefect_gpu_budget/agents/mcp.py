"""The MCP door: the gateway's operations as MCP tools over streamable HTTP, at `/mcp`.

The same bearer token as REST opens it. Every HTTP request to `/mcp` is checked by
`Door.caller` before the MCP SDK sees it: no token or a bad one is an HTTP 401 with
`WWW-Authenticate: Bearer`, too many is a 429 (the door's headers, such as `Retry-After`, go
with it); each request, an MCP `initialize` or a notification as much as a tool call, counts
against the grant's call rate as a REST call does. The `Caller` rides in the request's ASGI
scope and each tool reads it from the request the SDK hands it, so a tool call always acts as
the token of the HTTP request that carries it. The server is stateless (no `Mcp-Session-Id` to
hijack or to keep) and answers in JSON; it takes only POSTs (405 otherwise: there is no
stream to GET).

A `Refused` becomes a tool error (`isError`) whose text is `"<status>: <detail>"`, exactly what
REST says; anything else is `"500: internal error (<type>)"` (503 when the Prefect API is
down), never a traceback.

Mounting, in the gateway's `create_app` (the session manager must run in its lifespan)::

    from prefect_gpu_budget.agents.mcp import mcp_app

    mcp_asgi, mcp_running = mcp_app(lambda: door)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with mcp_running():
            ...  # the gateway's own setup
            yield

    app = FastAPI(..., lifespan=lifespan)
    app.add_route("/mcp", mcp_asgi, include_in_schema=False)

`mcp_app` builds a new server each call: its `running()` can be entered only once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Annotated, Any

import anyio.to_thread
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import CallToolResult, TextContent
from pydantic import Field
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prefect_gpu_budget.agents.callers import Caller, Refused
from prefect_gpu_budget.agents.door import MAX_LONG_POLL_S
from prefect_gpu_budget.agents.operations import BY_TOOL, ResultsFormat

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from prefect_gpu_budget.agents.door import Door

    Act = Callable[[Context, Callable[[Door, Caller], Any]], Awaitable[Any]]
    """Runs an operation of the door as the caller of the request that carries the context."""
    Tool = Callable[..., Callable[[Callable[..., Any]], Callable[..., Any]]]
    """Registers a function as a tool of the server."""

log = logging.getLogger(__name__)

CALLER_KEY = "prefect_gpu_budget.caller"
"""Where the authenticated `Caller` rides in an MCP request's ASGI scope."""
MAX_BODY_BYTES = 64 * 1024
"""Largest MCP request body, as for REST: a tool call is a few hundred bytes."""
WAIT_S = (
    "Long poll: answer once anything in the sweep changed, or after this many seconds "
    f"(at most {MAX_LONG_POLL_S:.0f}); 0 answers at once."
)
FORMAT = 'json: {"results": [one record per trial]}; csv: the table as CSV text.'


def _refusal(exc: Exception) -> tuple[int, str, dict[str, str]]:
    """What a caller may learn of a failure, as (status, detail, headers): a `Refused` as REST
    tells it, anything else by its type alone."""
    if isinstance(exc, Refused):
        return exc.status, exc.detail, dict(exc.headers or {})
    import httpx

    if isinstance(exc, httpx.HTTPError):
        return 503, "the Prefect API is unavailable", {}
    log.error("MCP door: unexpected failure", exc_info=exc)
    return 500, f"internal error ({type(exc).__name__})", {}


class _Authenticated:
    """ASGI: answer 401/429 unless `Door.caller` accepts the request's token, 405 to anything
    but a POST, else pass the request on with the `Caller` in its scope."""

    def __init__(self, inner: ASGIApp, door_of: Callable[[], Door]) -> None:
        self.inner, self.door_of = inner, door_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        client = scope.get("client")
        address = client[0] if client else "?"
        authorization = Headers(scope=scope).get("authorization")
        try:
            caller = await anyio.to_thread.run_sync(self.door_of().caller, authorization, address)
        except Exception as exc:
            status, detail, headers = _refusal(exc)
            if status == 401:
                headers.setdefault("WWW-Authenticate", "Bearer")
            response = JSONResponse({"detail": detail}, status_code=status, headers=headers)
            await response(scope, receive, send)
            return
        if scope["method"] != "POST":  # stateless: no stream to GET (it would hang), none to DELETE
            response = JSONResponse(
                {"detail": "this MCP endpoint is stateless: POST only"},
                status_code=405,
                headers={"Allow": "POST"},
            )
            await response(scope, receive, send)
            return
        await self.inner({**scope, CALLER_KEY: caller}, receive, send)


def mcp_app(
    door_of: Callable[[], Door],
) -> tuple[ASGIApp, Callable[[], AbstractAsyncContextManager[None]]]:
    """The MCP door over `door_of()`: an ASGI app to route at `/mcp`, and the context manager
    factory that runs its session manager (enter it once, in the host app's lifespan).

    1. The server, with its instructions. 2. Its tools, each an operation of the door run as
    the request's caller. 3. Its stateless streamable HTTP app, behind the token check."""
    server = MCPServer(
        "prefect-gpu-budget",
        instructions="GPU sweeps within a budget, for one agent session per token: start a "
        "sweep, follow it (get_sweep with wait_s long-polls), read its trials' metrics, "
        "results, plots and summary, cancel, forecast and quote before spending.",
        log_level="WARNING",
    )
    act = _actor(door_of)
    tool = _registrar(server)
    _sweep_tools(tool, act)
    _job_tools(tool, act)
    server.streamable_http_app(  # builds `server.session_manager`; its Starlette app is unused
        stateless_http=True,
        json_response=True,
        max_request_body_size=MAX_BODY_BYTES,
        # Host/Origin checks keep web pages off token-less local servers; a token guards this one.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    manager = server.session_manager
    return _Authenticated(StreamableHTTPASGIApp(manager), door_of), manager.run


def _actor(door_of: Callable[[], Door]) -> Act:
    async def act(ctx: Context, call: Callable[[Door, Caller], Any]) -> Any:
        """`call(door, caller)` off the event loop, as the caller of the request carrying `ctx`;
        a failure is an error result (the SDK would prefix a raised `ToolError`'s text)."""
        caller = getattr(ctx.request_context.request, "scope", {}).get(CALLER_KEY)
        if not isinstance(caller, Caller):  # unreachable behind `_Authenticated`
            status, detail = 401, "unknown or revoked token"
        else:
            try:
                return await anyio.to_thread.run_sync(call, door_of(), caller)
            except Exception as exc:
                status, detail, _ = _refusal(exc)
        text = TextContent(type="text", text=f"{status}: {detail}")
        return CallToolResult(content=[text], is_error=True)

    return act


def _registrar(server: MCPServer) -> Tool:
    def tool(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register a tool named as its function, described as its operation
        (`agents.operations`)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            op = BY_TOOL[fn.__name__]
            return server.tool(name=op.tool, description=op.description, **options)(fn)

        return register

    return tool


def _sweep_tools(tool: Tool, act: Act) -> None:
    """The tools that start a sweep and read it: its state, trials, results, plots, summary."""

    @tool()
    async def start_sweep(spec: dict[str, Any], ctx: Context) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: door.start_sweep(caller, spec))

    @tool()
    async def get_sweep(
        run_id: str,
        ctx: Context,
        wait_s: Annotated[float, Field(description=WAIT_S)] = 0,
    ) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: door.sweep(caller, run_id, wait_s))

    @tool()
    async def get_trial_metrics(
        run_id: str, trial: int, ctx: Context, offset: int = 0, limit: int = 500
    ) -> dict[str, Any]:
        return await act(
            ctx, lambda door, caller: door.trial_metrics(caller, run_id, trial, offset, limit)
        )

    @tool(structured_output=False)  # a CSV table is text, not a structure
    async def get_results(
        run_id: str,
        ctx: Context,
        format: Annotated[ResultsFormat, Field(description=FORMAT)] = "json",
    ) -> Any:
        if format == "csv":
            return await act(ctx, lambda door, caller: door.results_csv(caller, run_id))
        return await act(ctx, lambda door, caller: {"results": door.results(caller, run_id)})

    @tool()
    async def list_plots(run_id: str, ctx: Context) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: {"plots": door.plots(caller, run_id)})

    @tool()
    async def get_plot(run_id: str, name: str, ctx: Context) -> Image:
        return await act(
            ctx, lambda door, caller: Image(data=door.plot(caller, run_id, name), format="png")
        )

    @tool()
    async def get_summary(run_id: str, ctx: Context) -> str:
        return await act(ctx, lambda door, caller: door.summary(caller, run_id))


def _job_tools(tool: Tool, act: Act) -> None:
    """The tools that stop work, and those that price it before it is spent."""

    @tool()
    async def cancel_job(job_id: str, ctx: Context) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: door.cancel_job(caller, job_id))

    @tool()
    async def cancel_sweep(run_id: str, ctx: Context) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: door.cancel_sweep(caller, run_id))

    @tool()
    async def forecast_sweep(spec: dict[str, Any], ctx: Context) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: door.forecast(caller, spec))

    @tool()
    async def quote(
        instance_type: str,
        ctx: Context,
        nodes: int = 1,
        hours: float = 1.0,
        provisioning: str = "on-demand",
    ) -> dict[str, Any]:
        return await act(ctx, lambda door, _: door.quote(instance_type, nodes, hours, provisioning))

    @tool()
    async def place(
        accelerators: str,
        ctx: Context,
        nodes: int = 1,
        hours: float = 1.0,
        deadline_h: float | None = None,
        max_wait_h: float | None = None,
        resumable: bool = False,
    ) -> dict[str, Any]:
        asked = (accelerators, nodes, hours, deadline_h, max_wait_h, resumable)
        return await act(ctx, lambda door, caller: door.place(caller, *asked))

    @tool()
    async def get_status(ctx: Context) -> dict[str, Any]:
        return await act(ctx, lambda door, caller: door.status(caller))
