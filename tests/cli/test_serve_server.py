"""`serve` and `agents serve` without PREFECT_API_URL: each says in one line what it does
instead, they share one temporary Prefect server (`agents serve` uses `serve`'s), and after a
SIGINT or SIGTERM nothing they started is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.prefect_server import free_port, wait_for

START_S = 240.0
"""A first start migrates a new Prefect database: minutes on a loaded two-core machine."""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_API", "PREFECT_GPU_BUDGET_", "PREFECT_SERVER"))
    }
    env.update(
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_GPU_BUDGET_LEDGER_URL=f"sqlite:///{tmp_path / 'ledger.db'}",
        PREFECT_GPU_BUDGET_PRICES=str(tmp_path / "prices.csv"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    return env


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _of_home(home: str) -> list[str]:
    """The processes whose environment names `home` as PREFECT_HOME, with their command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if f"PREFECT_HOME={home}".encode() in environ:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry.name}: {cmdline}")
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_without_a_server_starts_one_and_leaves_nothing(tmp_path: Path, sig: int) -> None:
    env = _env(tmp_path)
    home = env["PREFECT_HOME"]
    serve_log, gateway_log = tmp_path / "serve.log", tmp_path / "gateway.log"
    serve = _start(["serve"], env, serve_log)
    gateway = None
    try:
        wait_for(lambda: "serving " in serve_log.read_text(), START_S, "serve to serve")
        said = serve_log.read_text()
        lines = [line for line in said.splitlines() if "no PREFECT_API_URL" in line]
        assert len(lines) == 1 and "starting a temporary Prefect server" in lines[0], said
        record = json.loads((Path(home) / "gpu-budget" / "temporary-server.json").read_text())
        gateway = _start(["agents", "serve", "--port", str(free_port())], env, gateway_log)
        wait_for(
            lambda: "using the temporary Prefect server `serve`" in gateway_log.read_text(),
            START_S,
            "agents serve to take serve's server",
        )
        assert record["url"] in gateway_log.read_text()
        time.sleep(2.0)  # the gateway up and asking the server
        assert any(str(record["pid"]) in p for p in _of_home(home))
    finally:
        for proc in (gateway, serve):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, sig)  # the command alone, as `kill` would
        for proc in (gateway, serve):
            if proc is not None:
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    deadline = time.monotonic() + 30
    while (left := _of_home(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left running after {signal.Signals(sig).name}: {left}"
    assert not (Path(home) / "gpu-budget" / "temporary-server.json").exists()
