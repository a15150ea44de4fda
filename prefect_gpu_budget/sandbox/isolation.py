"""The job's own network, files and /proc: what `PREFECT_GPU_BUDGET_AGENT_NETWORK` asks for, and
whether this host can give it.

The walls themselves are the job holder's (`holder.py --isolate`, `--keep`, `--tmp-size`,
`--proxy`): a network namespace of the job's own with only its own loopback (no address of the
host, its loopback included), an IPC namespace of its own, a mount namespace with `/proc` for its
own PID namespace, its own /run, /tmp, /var/tmp and /dev/shm and every host socket covered
(`walls.py`), Landlock where the kernel has it, and, in proxy mode, a relay on the job's own
loopback to the admin's proxy as its one way out (`relay.py`). Here: the mode (`proxy_of`), and
the holder's answer to whether it can make them (`isolation_refused`), asked once per process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from prefect_gpu_budget import settings
from prefect_gpu_budget.job import LaunchConfigError

PROXY_ENVS: tuple[str, ...] = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
"""Set, in proxy mode, to the relay on the job's own loopback."""
NETWORK_HOST = "host"
"""`PREFECT_GPU_BUDGET_AGENT_NETWORK=host`: the admin's opt-out of the job's own network."""
HOLDER_SCRIPT = str(Path(__file__).with_name("holder.py"))
"""The job holder, run as a file (`python -I -S holder.py ... -- command`)."""


def proxy_of(network: str) -> tuple[str, int] | None:
    """The proxy a `Sandbox.network` names, as (host, port); None for `none` and `host`;
    `LaunchConfigError` naming the setting for anything else."""
    if network in ("none", NETWORK_HOST):
        return None
    parts = urlsplit(network)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise LaunchConfigError(
            "local",
            f"{settings.AGENT_NETWORK_ENV} must be none, host or an HTTP(S) proxy's URL "
            f"(http://proxy:3128), got {network[:80]!r}",
        )
    return parts.hostname, port


@functools.cache
def isolation_refused(euid: int) -> str:
    """'' when the job holder can give a job its own PID, network and mount namespaces here
    (`holder.py --probe`, once per process and user), else why not, in a few words."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", HOLDER_SCRIPT, "--probe"],
            capture_output=True,
            text=True,
            errors="replace",
            cwd="/",
            env={k: v for k, v in os.environ.items() if k == "LD_LIBRARY_PATH"},
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the job holder did not answer: {exc}"
    if done.returncode == 0:
        return ""
    said = (done.stdout + done.stderr).strip().splitlines() or [f"exit code {done.returncode}"]
    return said[-1].rpartition("isolation refused: ")[2][:200]
