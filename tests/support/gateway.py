"""The agents' gateway stack of the tests, started as the README deploys it.

`GatewayStack` runs, against the Prefect server and the ledger its environment names,
`prefect-gpu-budget serve` (the worker of the agent deployment; left out with `serve=False`) and
one gateway or more (`prefect-gpu-budget agents serve` on a free port each), every one a process
group of its own writing to `<cwd>/<name>.log`. Entered, it returns once the agent deployment
has been polled by its worker (the gateway starts no sweep before) and every gateway answers;
left, it stops them all. The Prefect server and the ledger stay the test's.

`GatewayClient` makes the HTTP calls an agent makes, as `curl` would; `bearer` and `stale_token`
are the headers of such a call and a token no ledger granted.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tests.support.prefect_server import free_port, stop_groups, wait_for
from tests.support.prefect_server import http as prefect_http

DEPLOYMENT = "agent-sweep/agents"
"""The agent deployment `serve` runs, and the gateway starts sweeps of."""
SERVE_S = 180.0
"""How long `serve` may take to have its worker poll the deployment."""
UP_S = 120.0
"""How long a gateway may take to answer."""


class GatewayClient:
    """HTTP calls to the gateway, as `curl` would make them."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.seen: list[str] = []
        """Every response body: searched for planted secrets at the end."""

    def call(
        self, method: str, path: str, token: str | None = None, body: object = None, raw=None
    ) -> tuple[int, dict]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(
            self.base + path, data=data, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                code, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            code, text = exc.code, exc.read().decode()
        self.seen.append(text)
        return code, (json.loads(text) if text.startswith("{") else {"text": text})

    def sweep_until_done(self, token: str, run_id: str, timeout: float = 240) -> dict:
        """Poll as an agent would: every 2 s, well within the gateway's calls per minute."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code, run = self.call("GET", f"/v1/sweeps/{run_id}", token)
            assert code == 200, run
            if run["state"] in ("Completed", "Failed", "Crashed"):
                return run
            time.sleep(2.0)
        raise AssertionError(f"sweep {run_id} still {run['state']} after {timeout:.0f}s")


class GatewayStack:
    """`serve` and the gateways `names` (each `agents serve --port <free> *args`) in `cwd`, with
    the environment `env` (`PREFECT_API_URL` and, for a closed server, `PREFECT_API_AUTH_STRING`
    among it when `serve` is started). `bases` are the gateways' URLs in the order of `names`."""

    def __init__(
        self,
        env: dict[str, str],
        cwd: Path,
        *,
        serve: bool = True,
        names: Sequence[str] = ("gateway",),
        args: Sequence[str] = (),
        grace: float = 30.0,
    ) -> None:
        self.env, self.cwd, self.serve, self.grace = env, Path(cwd), serve, grace
        self.ports = {name: free_port() for name in names}
        self.args = list(args)
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def bases(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports.values()]

    @property
    def base(self) -> str:
        """The first gateway's URL."""
        return self.bases[0]

    def client(self, base: str | None = None) -> GatewayClient:
        return GatewayClient(base or self.base)

    def log(self, name: str) -> str:
        path = self.cwd / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def __enter__(self) -> GatewayStack:
        try:
            if self.serve:
                self._start("serve", ["serve"])
            for name, port in self.ports.items():
                self._start(name, ["agents", "serve", "--port", str(port), *self.args])
            if self.serve:
                wait_for(self._polled, SERVE_S, "the agent deployment, polled by its worker")
            for name, base in zip(self.ports, self.bases, strict=True):
                self._until_up(name, base)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        stop_groups(list(self.procs.values()), grace=self.grace)
        self.procs.clear()

    def _start(self, name: str, args: list[str]) -> None:
        with (self.cwd / f"{name}.log").open("w") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _polled(self) -> object:
        api, auth = self.env["PREFECT_API_URL"], self.env.get("PREFECT_API_AUTH_STRING")
        return prefect_http(f"{api}/deployments/name/{DEPLOYMENT}", auth=auth)["last_polled"]

    def _until_up(self, name: str, base: str) -> None:
        """Until `base` answers, failing with the gateway's log if it ends or takes too long."""
        proc, client = self.procs[name], GatewayClient(base)
        deadline = time.monotonic() + UP_S
        while True:
            try:
                if client.call("GET", "/openapi.json")[0] == 200:
                    return
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the gateway at {base} did not start:\n{self.log(name)}")
            time.sleep(0.25)


def stale_token() -> str:
    """A token the ledger never granted, shaped like one that it did."""
    return "gpub_" + secrets.token_urlsafe(32)


def bearer(token: str, **headers: str) -> dict[str, str]:
    """The headers of a call made with `token` (and `headers`)."""
    return {"Authorization": f"Bearer {token}", **headers}
