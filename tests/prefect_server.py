"""A real `prefect server start` for tests that need what the test harness lacks: the lease
repossessor, durable (filesystem) lease storage, the UI, and being stopped and started again."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, auth: str | None = None) -> dict:
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


def wait_for(check, timeout: float, what: str):
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


class PrefectServer:
    """`prefect server start` on a free port with its own PREFECT_HOME and durable leases."""

    def __init__(self, home: Path, ui: bool = False, auth: str | None = None) -> None:
        self.home = home
        self.auth = auth
        """The basic-auth string that closes the API to everyone else."""
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
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": (
                "prefect.server.concurrency.lease_storage.filesystem"
            ),
        }
        if auth is not None:
            self.env["PREFECT_SERVER_API_AUTH_STRING"] = auth
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 180) -> PrefectServer:
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
            + ["--port", str(self.port)],
            env=self.env,
            stdout=(self.home.parent / f"server-{self.starts}.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: http(f"{self.api}/health"), timeout, "the Prefect server")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def client_env(self, **extra: str) -> dict[str, str]:
        """The environment for a process that talks to this server."""
        auth = {} if self.auth is None else {"PREFECT_API_AUTH_STRING": self.auth}
        server_only = ("PREFECT_SERVER_API_AUTH_STRING",)
        env = {k: v for k, v in self.env.items() if k not in server_only}
        return {**env, "PREFECT_API_URL": self.api, **auth, **extra}
