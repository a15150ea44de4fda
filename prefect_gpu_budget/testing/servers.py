"""A real `prefect server start`, for the benchmarks and for the tests that need what Prefect's
test harness lacks: the lease repossessor, durable (filesystem) lease storage, a PostgreSQL
database, the UI, basic auth, being stopped and started again.

`prefect_server()` is the short form: a server of its own for the block, its API URL exported
to this process and its children. `PrefectServer` is the server itself (its pid, restarts, the
environment of a client)."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
FILESYSTEM_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, auth: str | None = None) -> Any:
    """One JSON call (with `auth`, a server's basic-auth string); a 503 (the server's SQLite is
    busy) is retried, as Prefect's client does."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    for attempt in range(10):
        request = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == 9:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def wait_for(check: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `check` every 0.5 s until it returns something true (exceptions: not yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception:  # not up yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def stop_groups(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM every process group at once; SIGKILL what has not ended `grace` s later."""
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def read_line(proc: subprocess.Popen, deadline: float) -> str:
    """The next line a child process (an agent) writes to its stdout pipe; "" if it exits, or
    says nothing, before `deadline` (monotonic)."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            return ""
    return ""


class PrefectServer:
    """`prefect server start` on a free port with its own PREFECT_HOME, in a process group of
    its own. Its log goes to `<home>/../server-<n>.log` for the n-th start.

    - `services=False` (`--no-services`): no lease repossessor, so a leaked slot stays taken;
    - `durable_leases`: leases in filesystem storage (they outlive a restart), else in memory;
    - `database_url`: the server's own database (e.g. `postgresql+asyncpg://...`), else SQLite
      in its home;
    - `auth`: the basic-auth string that closes the API to everyone else."""

    def __init__(
        self,
        home: Path,
        ui: bool = False,
        auth: str | None = None,
        *,
        services: bool = True,
        durable_leases: bool = True,
        database_url: str | None = None,
    ) -> None:
        self.home = home
        self.auth = auth
        self.services = services
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.base}/api"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")},
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_ENABLED": "true" if ui else "false",
            "PREFECT_UI_API_URL": self.api,
            "PREFECT_SERVER_UI_API_URL": self.api,
        }
        if durable_leases:
            self.env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] = FILESYSTEM_LEASES
        if database_url is not None:
            self.env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
        if auth is not None:
            self.env["PREFECT_SERVER_API_AUTH_STRING"] = auth
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.home.parent / f"server-{self.starts}.log"

    def start(self, timeout: float = 180) -> PrefectServer:
        """Start it and wait until its API answers; raise with its log's tail if it ends first."""
        self.starts += 1
        self.home.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
        command += ["--port", str(self.port)] + ([] if self.services else ["--no-services"])
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"the Prefect server ended (exit {proc.returncode}):\n{tail}")
            try:
                return bool(http(f"{self.api}/health"))
            except Exception:  # not up yet
                return False

        deadline = time.monotonic() + timeout
        while not up():
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("timed out waiting for the Prefect server")
            time.sleep(0.5)
        return self

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is not None:
            stop_groups([self.proc], grace)
            self.proc = None

    def client_env(self, **extra: str) -> dict[str, str]:
        """The environment for a process that talks to this server."""
        auth = {} if self.auth is None else {"PREFECT_API_AUTH_STRING": self.auth}
        server_only = ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_SERVER_DATABASE_CONNECTION_URL")
        env = {k: v for k, v in self.env.items() if k not in server_only}
        return {**env, "PREFECT_API_URL": self.api, **auth, **extra}

    def __enter__(self) -> PrefectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def quiet_prefect() -> None:
    """Settings for a benchmark's process and its children, before Prefect is imported: no
    analytics, no UI, and Prefect's own logging at warnings unless the caller chose a level."""
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def bare_postgres_server(home: Path, prefect_url: str) -> PrefectServer:
    """A `PrefectServer` (not started) for load benchmarks: `--no-services`, leases in memory,
    the PostgreSQL database `prefect_url` (asyncpg driver), its own log at warnings.

    Without services the lease repossessor does not run, so a leaked slot stays taken and a
    check at the end sees it; a production server would hand it back about 75 s later."""
    db = "postgresql+asyncpg://" + prefect_url.split("://", 1)[1]
    server = PrefectServer(home, services=False, durable_leases=False, database_url=db)
    server.env["PREFECT_SERVER_LOGGING_LEVEL"] = "WARNING"
    return server


@contextmanager
def serving(api_url: str) -> Iterator[str]:
    """Point this process (its Prefect settings) and the processes it starts (`PREFECT_API_URL`
    in the environment) at `api_url` for the block."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url
    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            yield api_url
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before


@contextmanager
def prefect_server(home: Path | None = None, **options: Any) -> Iterator[str]:
    """A `PrefectServer` of its own for the block (`options` as its constructor's; a temporary
    home unless `home` is given), served to this process and its children: yields its API URL."""
    with tempfile.TemporaryDirectory(prefix="prefect-server-") as tmp:
        server = PrefectServer(home or Path(tmp) / "home", **options)
        with server, serving(server.api) as url:
            yield url
