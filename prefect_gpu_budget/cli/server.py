"""The Prefect server of a command that serves (`serve`, `agents serve`) where none is configured.

Without PREFECT_API_URL, Prefect starts a temporary server in every process that asks it
anything: `serve`, `agents serve` and each sweep `serve` ran started one each, on the same
SQLite file (slow starts, `database is locked`), and one that `serve` left at its end lived on.
Here such a command starts one server itself, before Prefect is imported, and exports its URL
to itself and to everything it starts, so its sweeps use that one; `agents serve` started
after `serve` on the same PREFECT_HOME uses `serve`'s. One line says which.

The server is a process of its own (`uvicorn` with Prefect's app, its background services
included: schedules fire and lapsed leases come back), in a session of its own so that the
terminal's Ctrl-C reaches only the command, which still needs it while it stops its sweeps.
The command stops it as it ends (`stop`, also at exit); the kernel stops it if the command is
killed outright (PR_SET_PDEATHSIG). Nothing it starts outlives it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import typer

START_TIMEOUT_S = 180.0
"""How long a first start may take on a busy machine (it migrates a new database)."""
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1

_started: dict[str, subprocess.Popen] = {}


def _record() -> Path:
    """Where `serve` writes the URL and pid of the server it started, for `agents serve`."""
    from prefect_gpu_budget import settings

    return settings.prefect_home() / "gpu-budget" / "temporary-server.json"


def ensure_server(command: str) -> None:
    """Give this process (and what it starts) a Prefect server: the configured one, else a
    running one `serve` started on this PREFECT_HOME (for `agents serve`), else one of its
    own, started now and stopped with it; one line on stderr says which."""
    from prefect_gpu_budget import settings

    if settings.prefect_api_url():
        return
    if "prefect" in sys.modules:  # its settings are read: too late to point it elsewhere
        return
    shared = _shared() if command != "serve" else None
    if shared is not None:
        url, pid = shared
        os.environ["PREFECT_API_URL"] = url
        typer.echo(
            f"{command}: no PREFECT_API_URL; using the temporary Prefect server `serve` "
            f"(pid {pid}) started at {url}, which stops with it (for a lasting one: "
            "`prefect server start` and export PREFECT_API_URL)",
            err=True,
        )
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    typer.echo(
        f"{command}: no PREFECT_API_URL; starting a temporary Prefect server at {url} for it "
        "and the sweeps it runs, stopped when it stops (to share one: `prefect server start` "
        "and export PREFECT_API_URL)",
        err=True,
    )
    proc = _start(port)
    _started["server"] = proc
    atexit.register(stop)
    if command == "serve":
        with contextlib.suppress(OSError):
            _record().parent.mkdir(parents=True, exist_ok=True)
            _record().write_text(json.dumps({"url": url, "pid": proc.pid, "by": os.getpid()}))
    _wait_healthy(url, proc)
    os.environ["PREFECT_API_URL"] = url


def stop() -> None:
    """Stop the server this process started, if any (SIGTERM, then SIGKILL after a grace)."""
    proc = _started.pop("server", None)
    if proc is None:
        return
    with contextlib.suppress(OSError, ValueError):
        found = json.loads(_record().read_text())
        if found.get("pid") == proc.pid:
            _record().unlink()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _start(port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # the terminal's Ctrl-C is the command's to handle
        preexec_fn=_die_with_parent,
    )


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when the command that started it dies."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the command died before the line above took hold
        os._exit(1)


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop()
            from prefect_gpu_budget.cli.common import fail

            fail(f"the temporary Prefect server exited with code {proc.returncode}", code=1)
        if _healthy(url):
            return
        time.sleep(0.5)
    stop()
    from prefect_gpu_budget.cli.common import fail

    fail(f"the temporary Prefect server did not answer within {START_TIMEOUT_S:.0f}s", code=1)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def _shared() -> tuple[str, int] | None:
    """The URL and pid of a temporary server `serve` runs on this PREFECT_HOME, once it
    answers; None where there is none."""
    try:
        found = json.loads(_record().read_text())
        url, pid = str(found["url"]), int(found["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return None  # another user's
        if _healthy(url):
            return url, pid
        time.sleep(0.5)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
