"""The agent gateway: the one door agents have (`prefect-gpu-budget agents serve`), over HTTP
(REST, OpenAPI at `/docs`) and MCP (streamable HTTP at `/mcp`), both calling `agents.door`.

An agent holds its token and this gateway's URL, nothing else. The token travels in an
`Authorization: Bearer` header and is checked against the ledger's grants on every call; the
gateway, a trusted client of a Prefect API that agents cannot reach (closed with
`PREFECT_SERVER_API_AUTH_STRING`), starts `agent-sweep/agents` with the agent's session and its
grant's id, never the token. Another session's run or job is a 404, exactly like one that does
not exist; a bad spec is a 422 whose one-line reason names the field; too many failed tokens
from one client, too many calls, or more sweeps than the team's limits allow is a 429.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from prefect_gpu_budget.admission.ledger import open_ledger
from prefect_gpu_budget.agents.callers import Refused
from prefect_gpu_budget.agents.door import DEPLOYMENT, Door
from prefect_gpu_budget.agents.mcp import mcp_app
from prefect_gpu_budget.agents.routes import ROUTERS
from prefect_gpu_budget.settings import gateway_trusted_proxies, ledger_url

MAX_BODY_BYTES = 64 * 1024
"""Largest request body: a sweep spec is a few hundred bytes; nothing big is parsed."""
DESCRIPTION = (
    "Sweeps, their trials, results, plots and spend, forecasts and quotes, and stopping jobs "
    "and sweeps, for one agent session per token (`Authorization: Bearer gpub_...`). The same "
    "operations are MCP tools at `/mcp`."
)


def create_app(
    url: str | None = None,
    deployment: str = DEPLOYMENT,
    trusted_proxies: str | Iterable[Any] | None = None,
) -> FastAPI:
    """The gateway over the ledger at `url` (default: the configured one) and the Prefect API
    of this process's settings (`PREFECT_API_URL`, `PREFECT_API_AUTH_STRING`).

    `trusted_proxies` (IPs or CIDRs, as a comma-separated string or networks; default
    PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES, empty): the only peers whose `X-Forwarded-For`
    is believed; see `ClientAddress`. A bad entry is a ValueError naming it."""
    trusted = (
        gateway_trusted_proxies(trusted_proxies)
        if trusted_proxies is None or isinstance(trusted_proxies, str)
        else tuple(ipaddress.ip_network(n, strict=False) for n in trusted_proxies)
    )
    door = Door(open_ledger(ledger_url(url)), deployment=deployment)
    mcp_asgi, mcp_running = mcp_app(lambda: door)
    app = FastAPI(
        title="prefect-gpu-budget agent gateway",
        version="1",
        lifespan=partial(_serving, mcp_running=mcp_running),
        description=DESCRIPTION,
    )
    app.state.door = door  # what the routes reach it by (`routes.the_door`)
    app.add_route("/mcp", mcp_asgi, include_in_schema=False)
    app.add_middleware(ClientAddress, trusted=trusted)  # REST and MCP see the same client
    app.middleware("http")(_bounded_body)
    app.add_exception_handler(RequestValidationError, _bad_request)
    app.add_exception_handler(Refused, _refused)
    app.add_exception_handler(httpx.HTTPError, _prefect_down)
    app.add_exception_handler(Exception, _internal)
    for router in ROUTERS:
        app.include_router(router)
    return app


@asynccontextmanager
async def _serving(
    app: FastAPI, mcp_running: Callable[[], AbstractAsyncContextManager[Any]]
) -> AsyncIterator[None]:
    """The app's lifespan: the MCP server runs, and the door has its Prefect client."""
    from prefect.client.orchestration import get_client

    async with mcp_running():
        with get_client(sync_client=True) as client:
            app.state.door.prefect = client
            yield


async def _bounded_body(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """No body over `MAX_BODY_BYTES` (413), and none of unknown length (411), is read."""
    size = request.headers.get("content-length")
    if size is None and "transfer-encoding" in request.headers:
        return JSONResponse({"detail": "a body needs a Content-Length"}, status_code=411)
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
        return JSONResponse({"detail": f"body: at most {MAX_BODY_BYTES} bytes"}, status_code=413)
    return await call_next(request)


async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A 422 in one line naming the field: its first error only."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    return JSONResponse({"detail": f"{where}: {err.get('msg', 'invalid')}"}, status_code=422)


async def _refused(_: Request, exc: Refused) -> JSONResponse:
    """The door's refusal, as its status, detail and headers say."""
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)


async def _prefect_down(_: Request, exc: httpx.HTTPError) -> JSONResponse:
    return JSONResponse({"detail": "the Prefect API is unavailable"}, status_code=503)


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    """Any other error: its type's name, never a traceback or a URL."""
    return JSONResponse({"detail": f"internal error ({type(exc).__name__})"}, status_code=500)


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    url: str | None = None,
    trusted_proxies: str | Iterable[Any] | None = None,
) -> None:
    """Run the gateway until stopped. uvicorn's own proxy headers are off (by default it
    believes `X-Forwarded-For` from 127.0.0.1, which any local user can connect from): the
    client address is `ClientAddress`'s alone."""
    import uvicorn

    uvicorn.run(
        create_app(url, trusted_proxies=trusted_proxies),
        host=host,
        port=port,
        log_level="info",
        proxy_headers=False,
        forwarded_allow_ips="",
    )


def _ip(text: str) -> Any:
    """The IP address of one `X-Forwarded-For` hop (a port, IPv6 brackets and an IPv4 address
    mapped into IPv6 dropped); None for anything else."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return ip.ipv4_mapped if ip.version == 6 and ip.ipv4_mapped is not None else ip


def client_address(peer: str, forwarded_for: Iterable[str], trusted: tuple[Any, ...]) -> str:
    """The client of a request whose socket peer is `peer`: the peer itself, unless it is a
    trusted proxy; then the right-most hop of `X-Forwarded-For` (its header lines in order)
    that is not a trusted proxy: hops to its left are whatever the client wrote. A hop that is
    no IP address stops the walk at the trusted proxy before it."""
    ip = _ip(peer)
    if ip is None or not any(ip in net for net in trusted):
        return peer if ip is None else str(ip)
    address = str(ip)
    hops = [hop for line in forwarded_for for hop in line.split(",") if hop.strip()]
    for hop in reversed(hops):
        ip = _ip(hop)
        if ip is None:
            break
        address = str(ip)
        if not any(ip in net for net in trusted):
            break
    return address


class ClientAddress:
    """ASGI: set the request's client (`scope["client"]`, which REST's `request.client` and
    the MCP door read) to `client_address`: `X-Forwarded-For` counts only from a trusted proxy."""

    def __init__(self, app: ASGIApp, trusted: tuple[Any, ...] = ()) -> None:
        self.app, self.trusted = app, tuple(trusted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.trusted and scope.get("client"):
            host, port = scope["client"]
            forwarded = [
                value.decode("latin-1")
                for name, value in scope.get("headers", ())
                if name.lower() == b"x-forwarded-for"
            ]
            address = client_address(host, forwarded, self.trusted)
            if address != host:
                scope = {**scope, "client": (address, port)}
        await self.app(scope, receive, send)
