"""A synchronous MCP client for tests: the SDK's own streamable HTTP client and `ClientSession`,
one fresh session per call, with `Authorization: Bearer <token>` (no header for an empty token)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import anyio
import httpx2
import uvicorn
from fastapi import FastAPI
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import Tool

T = TypeVar("T")


class HTTPRefused(Exception):
    """The server answered the HTTP request itself with 401 or 429 (before any MCP)."""

    def __init__(self, status: int, detail: str, headers: dict[str, str]) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail, self.headers = status, detail, headers


async def _with_session(url: str, token: str, use: Callable[[ClientSession], Awaitable[T]]) -> T:
    refused: list[HTTPRefused] = []

    async def watch(response: httpx2.Response) -> None:
        if response.status_code in (401, 429) and not refused:
            await response.aread()
            try:
                detail = str(response.json().get("detail", ""))
            except ValueError:
                detail = response.text
            refused.append(HTTPRefused(response.status_code, detail, dict(response.headers)))

    failure: MCPError | None = None
    async with (
        httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=httpx2.Timeout(30.0, read=120.0),
            event_hooks={"response": [watch]},
        ) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        try:
            await session.initialize()
            return await use(session)
        except MCPError as exc:
            failure = exc
    if refused:
        raise refused[0]
    assert failure is not None
    raise failure


def call_tool(url: str, token: str, name: str, arguments: dict[str, Any]) -> tuple[bool, list]:
    """Call one tool: (is_error, its content blocks). Raises `HTTPRefused` on an HTTP 401/429."""

    async def call(session: ClientSession) -> tuple[bool, list]:
        result = await session.call_tool(name, arguments)
        return bool(result.is_error), list(result.content)

    return anyio.run(_with_session, url, token, call)


def list_tools(url: str, token: str) -> list[str]:
    """The server's tool names. Raises `HTTPRefused` on an HTTP 401/429."""
    return [tool.name for tool in tools(url, token)]


def tools(url: str, token: str) -> list[Tool]:
    """The server's tools as a client lists them: name, description, input schema."""

    async def listed(session: ClientSession) -> list[Tool]:
        return list((await session.list_tools()).tools)

    return anyio.run(_with_session, url, token, listed)


@contextmanager
def serving_mcp(door: Any) -> Iterator[str]:
    """The MCP door over `door`, served by uvicorn on a free port: its URL."""
    from prefect_gpu_budget.agents.mcp import mcp_app

    mcp_asgi, mcp_running = mcp_app(lambda: door)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        async with mcp_running():
            yield

    app = FastAPI(lifespan=lifespan)
    app.add_route("/mcp", mcp_asgi, include_in_schema=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
