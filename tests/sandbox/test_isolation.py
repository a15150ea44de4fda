"""An agent's job reaches nothing of its host (`sandbox/isolation.py`, the holder's
`--isolate`): real jobs, as `nobody`, trying what a hostile trial would.

Making namespaces and switching users needs a root worker (as CI runs); those tests skip
otherwise.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.sandbox import isolation
from prefect_gpu_budget.sandbox.launcher import Sandbox
from tests.sandbox.sandboxed import box_quote, open_folder, run_job

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and users need a root worker")

PROBE = (
    "import os, socket, sys\n"
    "def tcp(port):\n"
    "    try:\n"
    "        socket.create_connection(('127.0.0.1', port), timeout=5).close()\n"
    "        return 'open'\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
    "print('host', tcp(int(sys.argv[1])))\n"
    "print('procs', sum(p.isdigit() for p in os.listdir('/proc')))\n"
    "cmdlines = []\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n"
    "        cmdlines.append(open('/proc/%s/cmdline' % p, 'rb').read())\n"
    "    except OSError:\n"
    "        pass\n"
    "marker = sys.argv[2][::-1].encode()  # given reversed: its own command line is not it\n"
    "print('seen', any(marker in c for c in cmdlines if marker != b'-'))\n"
)
"""What a hostile trial runs: TCP to a port the host listens on (loopback), the processes its
/proc shows, and whether any host command line holding a marker is among them."""


@pytest.fixture
def base() -> Iterator[Path]:
    with open_folder("gpu-isolation-test-") as path:
        yield path


@pytest.fixture
def quote(prices: Path):
    return box_quote(prices)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP port the host listens on, on its loopback, as PostgreSQL or the API would."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock


@as_root
def test_a_job_reaches_no_port_of_its_host_and_sees_no_process_of_it(base, quote, listener):
    marker = f"host-secret-{uuid.uuid4().hex}"
    host = subprocess.Popen(["sh", "-c", f"sleep 120 # {marker}"])  # a host command line
    port = listener.getsockname()[1]
    try:
        result, lines = run_job(
            Sandbox(user="nobody", root=base / "jobs"),
            quote,
            ["python3", "-c", PROBE, str(port), marker[::-1]],
        )
    finally:
        host.kill()
        host.wait()
    assert result.outcome == "completed", (result, lines)
    assert "host ConnectionRefusedError" in lines, lines  # its own loopback: nothing there
    procs = int(next(x for x in lines if x.startswith("procs ")).split()[1])
    assert 0 < procs <= 4, lines  # its init, python: none of the host's
    assert "seen False" in lines, lines


@as_root
def test_the_admins_opt_out_runs_it_on_the_hosts_network(base, quote, listener):
    """`PREFECT_GPU_BUDGET_AGENT_NETWORK=host`, in so many words: the job shares the host's
    network and /proc, as a plain process (the probe above, seen from the other side)."""
    port = listener.getsockname()[1]
    box = Sandbox(user="nobody", root=base / "jobs", network="host")
    result, lines = run_job(box, quote, ["python3", "-c", PROBE, str(port), "-"])
    assert result.outcome == "completed", (result, lines)
    assert "host open" in lines, lines
    assert int(next(x for x in lines if x.startswith("procs ")).split()[1]) > 4, lines


class _Proxy(http.server.BaseHTTPRequestHandler):
    """An HTTP proxy that answers every request itself and remembers what it was asked."""

    asked: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        type(self).asked.append(self.path)
        body = b"through the admin's proxy"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@as_root
def test_a_proxy_the_admin_names_is_the_jobs_one_way_out(base, quote):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    fetch = (
        "import os, urllib.request\n"
        "print('proxy', os.environ['HTTPS_PROXY'])\n"
        "print(urllib.request.urlopen('http://datasets.invalid/train.csv', timeout=20).read())\n"
    )
    try:
        box = Sandbox(user="nobody", root=base / "jobs", network=f"http://127.0.0.1:{port}")
        result, lines = run_job(box, quote, ["python3", "-c", fetch])
        assert result.outcome == "completed", (result, lines)
        assert 'b"through the admin\'s proxy"' in lines, lines
        assert _Proxy.asked == ["http://datasets.invalid/train.csv"]
        # the proxy is the one way out: its own port is not reachable past the relay
        result, lines = run_job(box, quote, ["python3", "-c", PROBE, str(port), "-"])
        assert "host ConnectionRefusedError" in lines, lines
    finally:
        server.shutdown()


@pytest.mark.parametrize("network", ["socks5://proxy:1080", "http://", "everything", "http://p:x"])
def test_a_bad_network_setting_is_refused_in_one_line(network: str, base, quote):
    box = Sandbox(user="nobody", root=base / "jobs", network=network)
    with pytest.raises(LaunchConfigError) as refused:
        LocalLauncher(box).preflight(
            GpuJob(instance_type="local:box", command=["true"], max_runtime="1m"), quote
        )
    reason = refused.value.reason
    assert "PREFECT_GPU_BUDGET_AGENT_NETWORK" in reason and "\n" not in reason


def test_a_host_that_refuses_namespaces_refuses_the_job_unless_opted_out(
    base, quote, monkeypatch: pytest.MonkeyPatch
):
    """The holder's own answer (`--probe`) is what decides; here it is made to say no."""
    from prefect_gpu_budget.sandbox import launcher as module

    monkeypatch.setattr(module, "isolation_refused", lambda euid: "Operation not permitted")
    job = GpuJob(instance_type="local:box", command=["true"], max_runtime="1m")
    with pytest.raises(LaunchConfigError) as refused:
        LocalLauncher(Sandbox(user="nobody", root=base / "jobs")).preflight(job, quote)
    reason = refused.value.reason
    assert "Operation not permitted" in reason and "PREFECT_GPU_BUDGET_AGENT_NETWORK=host" in reason
    if os.geteuid() == 0:  # opted out: it runs
        LocalLauncher(Sandbox(user="nobody", root=base / "jobs", network="host")).preflight(
            job, quote
        )


@as_root
def test_the_holders_probe_says_yes_on_a_host_that_can():
    assert isolation.isolation_refused(os.geteuid()) == ""
