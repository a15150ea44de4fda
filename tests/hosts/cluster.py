"""Several hosts on one machine: Prefect's multi-replica server, and hosts made of network and UTS
namespaces, for the multi-host tests (tests/hosts/) and benchmark (benchmarks/hosts.py).

What `cluster()` starts, as Prefect's "How to scale self-hosted Prefect" page lays it out:

- Redis: a `redis-server` of the run's own on a free loopback port (messaging in DB 0, Docket in
  DB 1), or, where no `redis-server` is installed, the one `GPU_BUDGET_TEST_REDIS_URL` names
  (default `redis://127.0.0.1:6379`) in a database number the run claims and empties after;
- the Prefect database (a PostgreSQL database the caller made for the run), migrated once with
  `prefect server database upgrade -y`;
- N API replicas, `prefect server start --no-services`, and one `prefect server services start`
  (the lease repossessor among its services), all with the settings of `server_settings`;
- a load balancer in front of the replicas (`relay.py`, round robin, a dead replica skipped);
- the hosts: each a network namespace of its own (`ip netns`, its own loopback), joined by a
  veth pair to a bridge on a private /24 of the run's own (10.237.x.0/24, x free when it
  starts), and each of its processes in a UTS namespace with the host's name (`unshare --uts`),
  so that holder ids (`host:pid:start-ticks`) differ from host to host, and with a PREFECT_HOME
  of its own. The replicas and the load balancer listen on the bridge's address, and PostgreSQL
  (which listens on loopback) is reached through a relay on that address: the hosts reach
  nothing else of this machine. Given no databases (the benchmark), PostgreSQL is a cluster of
  the run's own (`PrivatePostgres`) that listens on that address itself: no relay in the
  ledger's path.

Without namespaces (not root, no `ip`, or `GPU_BUDGET_TEST_HOSTS=loopback`) the hosts are only
process groups of this machine on loopback: `Network.why_not` says why, and tests that need
hosts apart skip with that reason.

Everything started is stopped (process groups, SIGTERM then SIGKILL) and the namespaces and the
bridge are deleted when the block ends, however it ends. Names carry the run's owner
(tests/support/runs.py), so a run killed outright leaves them to the next one, which removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.support import runs

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.237"
"""The /16 whose /24s the runs take, one each."""
NETNS_PREFIX = "gpu-budget-hosts-"
BRIDGE_PREFIX = "gbh"
LOCK_FILE = Path(tempfile.gettempdir()) / "gpu-budget-hosts.lock"
"""Held while a run picks its /24 and makes its bridge, so two runs never take the same one."""
HOSTNAME_SCRIPT = 'hostname "$0" && exec "$@"'
STOP_GRACE_S = 15.0
SERVER_START_S = 240.0
"""How long a replica may take to answer /api/health (a 2-core machine under load)."""


def server_settings(
    database_url: str, redis_host: str, redis_port: int, redis_db: int, docket_url: str
) -> dict[str, str]:
    """The settings every API replica and the background services share, as the README's
    "Several hosts" section gives them (tests/hosts/test_settings.py checks each name against
    the installed Prefect and prefect-redis)."""
    return {
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
        "PREFECT_API_DATABASE_MIGRATE_ON_START": "false",
        "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_HOST": redis_host,
        "PREFECT_REDIS_MESSAGING_PORT": str(redis_port),
        "PREFECT_REDIS_MESSAGING_DB": str(redis_db),
        "PREFECT_SERVER_DOCKET_URL": docket_url,
    }


def _quiet_env(**extra: str) -> dict[str, str]:
    """This process's environment without Prefect's settings (the parent's server or API URL
    must not leak into a replica or a host), quiet, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_UI_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def free_port(address: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def wait_until(check: Any, timeout: float, what: str, every: float = 0.5) -> Any:
    """Poll `check` until it returns something true (an exception counts as not yet); raise
    with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # not yet
            last = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group of `proc`, SIGKILL it `grace` seconds later if still there."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


# -- hosts -------------------------------------------------------------------------------------


@dataclass
class Host:
    """One "machine": its name (the hostname its processes see), its address, its PREFECT_HOME,
    and its network namespace (None on loopback, where it is only a group of processes)."""

    name: str
    address: str
    home: Path
    netns: str | None
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run on this host: in its network namespace, in a UTS namespace of its
        own named for it (the process then execs `argv`: its pid is the Popen's)."""
        if self.netns is None:
            return argv
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts"] + [
            "sh",
            "-c",
            HOSTNAME_SCRIPT,
            self.name,
            *argv,
        ]

    def start(self, argv: list[str], env: dict[str, str], log: Path, **popen: Any) -> Any:
        """Start `argv` on this host in a process group of its own; stderr to `log`."""
        with log.open("ab") as stderr:
            proc = subprocess.Popen(
                self.command(argv),
                env=env,
                cwd=ROOT,
                stderr=stderr,
                start_new_session=True,
                **popen,
            )
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> Any:
        """Run `argv` on this host to its end; its CompletedProcess (text output)."""
        return subprocess.run(
            self.command(argv), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def pids(self) -> list[int]:
        """Every live process of this host: of its network namespace, or its own groups."""
        if self.netns is not None:
            out = _ip("netns", "pids", self.netns, check=False).stdout
            return [int(p) for p in out.split()]
        return [p.pid for p in self.procs if p.poll() is None]

    def kill(self, timeout: float = 30.0) -> int:
        """The host dies: SIGKILL every process of it, at once, until none is left (or
        `timeout`); how many were killed. Its processes' records stay as they were."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.pids()
            if self.netns is None:
                for proc in self.procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(found)
            for proc in self.procs:  # reap our children, so their pids leave the namespace
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.2)
            if not found:
                break
        return len(killed)

    def stop(self) -> None:
        """End every process of this host: SIGTERM each group, then kill what is left."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()


class Network:
    """The hosts' network. `why_not` is None when the hosts are namespaces apart; else why they
    are only process groups on loopback. `gateway` is the address the servers listen on."""

    def __init__(self, root: Path, tag: str) -> None:
        self.root = root
        self.tag = tag
        self.why_not: str | None = namespaces_unavailable()
        self.gateway = "127.0.0.1"
        self.bridge: str | None = None
        self.hosts: list[Host] = []
        self._octet: int | None = None

    @property
    def apart(self) -> bool:
        return self.why_not is None

    def open(self, count: int) -> None:
        """Make `count` hosts (and the bridge); on failure fall back to loopback, saying why."""
        if self.apart:
            try:
                self._make_bridge()
                for n in range(1, count + 1):
                    self.hosts.append(self._make_host(n))
                return
            except OSError as exc:
                self.close()
                self.why_not = f"network namespaces could not be made here ({exc})"
                self.gateway = "127.0.0.1"
        for n in range(1, count + 1):
            home = self.root / f"host{n}"
            home.mkdir(parents=True, exist_ok=True)
            self.hosts.append(Host(f"host{n}", "127.0.0.1", home, None))

    def _make_bridge(self) -> None:
        reap_ended()
        with LOCK_FILE.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _ip("-4", "addr").stdout))
            free = [x for x in range(1, 255) if str(x) not in taken]
            if not free:
                raise OSError(f"every {SUBNET}.x.0/24 is in use")
            self._octet = random.choice(free)
            self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
            self.gateway = f"{SUBNET}.{self._octet}.1"
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "alias", f"{NETNS_PREFIX}{runs.OWNER}")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    def _make_host(self, n: int) -> Host:
        netns = f"{NETNS_PREFIX}{runs.OWNER}-{self.tag}-h{n}"
        veth = f"{BRIDGE_PREFIX}{self.tag}v{n}"
        address = f"{SUBNET}.{self._octet}.{10 + n}"
        _ip("netns", "add", netns)
        host = Host(f"host{n}-{self.tag}", address, self.root / f"host{n}", netns)
        host.home.mkdir(parents=True, exist_ok=True)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", str(self.bridge), "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        """Stop every host's processes; delete the namespaces (their veth ends go with them)
        and the bridge."""
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.stop()
            if host.netns is not None:
                _ip("netns", "del", host.netns, check=False)
        self.hosts = []
        if self.bridge is not None:
            _ip("link", "del", self.bridge, check=False)
            self.bridge = None


def namespaces_unavailable() -> str | None:
    """Why hosts cannot be network namespaces here; None when they can."""
    if os.environ.get("GPU_BUDGET_TEST_HOSTS") == "loopback":
        return "GPU_BUDGET_TEST_HOSTS=loopback asks for hosts on loopback"
    if os.geteuid() != 0:
        return f"network namespaces (ip netns) need root; this run's uid is {os.geteuid()}"
    for tool in ("ip", "unshare", "hostname", "sh"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed, and the hosts' namespaces need it"
    return None


def reap_ended() -> None:
    """Delete the namespaces and bridges that runs which ended (killed outright) left."""
    pattern = re.compile(rf"{re.escape(NETNS_PREFIX)}(\d+_\d+_[0-9a-f]{{6}})-")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        found = pattern.match(name)
        if found and runs.ended(found[1]):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
    links = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    for block in re.finditer(rf"\d+: ({BRIDGE_PREFIX}\w+)[:@].*?alias (\S+)", links):
        owner = block[2].removeprefix(NETNS_PREFIX)
        if block[2].startswith(NETNS_PREFIX) and runs.ended(owner):
            _ip("link", "del", block[1], check=False)


# -- servers -----------------------------------------------------------------------------------


def _from_iso(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()


def _http(url: str, body: Any = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


@dataclass
class Replica:
    """One API replica: `prefect server start --no-services` on the gateway's address."""

    index: int
    address: str
    home: Path
    env: dict[str, str]
    port: int = 0
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def api(self) -> str:
        return f"http://{self.address}:{self.port}/api"

    @property
    def log(self) -> Path:
        return self.home.parent / f"replica{self.index}-{self.starts}.log"

    def launch(self) -> None:
        """Start it (the same port again after a kill); `wait` for it to answer."""
        self.starts += 1
        self.port = self.port or free_port(self.address)
        command = [sys.executable, "-m", "prefect", "server", "start", "--no-services"]
        command += ["--host", self.address, "--port", str(self.port)]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                command,
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def healthy(self) -> bool:
        try:
            return _http(f"{self.api}/health", timeout=5) is True
        except (OSError, ValueError):
            return False

    def wait(self, timeout: float = SERVER_START_S) -> None:
        proc = self.proc

        def up() -> bool:
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"replica {self.index} ended:\n{self.log.read_text()[-3000:]}")
            return self.healthy()

        deadline = time.monotonic() + timeout
        while not up():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"replica {self.index} did not answer in {timeout:.0f}s:\n"
                    + self.log.read_text()[-3000:]
                )
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the replica (its whole group): requests in flight fail."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None


class Redis:
    """The Redis the servers share: a private `redis-server`, else a claimed database number of
    the shared one. `host`, `port`, `messaging_db` and `docket_url` for `server_settings`."""

    CLAIM = "gpu-budget-hosts:claim"

    def __init__(self, folder: Path, tag: str) -> None:
        self.folder = folder
        self.tag = tag
        self.proc: subprocess.Popen | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.messaging_db = 0
        self.docket_url = ""
        self._claimed: Any = None

    def open(self) -> None:
        program = shutil.which("redis-server")
        if program is not None:
            self.port = free_port()
            with (self.folder / "redis.log").open("w") as log:
                self.proc = subprocess.Popen(
                    [program, "--port", str(self.port), "--bind", self.host, "--save", ""]
                    + ["--appendonly", "no", "--dir", str(self.folder), "--protected-mode", "no"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.docket_url = f"redis://{self.host}:{self.port}/1"
            wait_until(self._ping, 60, "the run's redis-server")
            return
        self._claim_shared()

    def _ping(self) -> bool:
        import redis

        client = redis.Redis(self.host, self.port, socket_timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def _claim_shared(self) -> None:
        """A database number of the shared Redis that holds nothing, claimed atomically; the
        Docket of the run shares it under a name of its own."""
        import redis

        url = urllib.parse.urlsplit(
            os.environ.get("GPU_BUDGET_TEST_REDIS_URL", "redis://127.0.0.1:6379")
        )
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 6379
        for db in range(1, 16):
            client = redis.Redis(self.host, self.port, db=db, socket_timeout=5)
            if client.dbsize() == 0 and client.set(self.CLAIM, runs.OWNER, nx=True):
                if client.dbsize() == 1:
                    self.messaging_db, self._claimed = db, client
                    self.docket_url = f"redis://{self.host}:{self.port}/{db}"
                    return
                client.delete(self.CLAIM)
            client.close()
        raise OSError(f"no empty Redis database at {self.host}:{self.port} to claim")

    def close(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None
        if self._claimed is not None:
            with contextlib.suppress(Exception):
                self._claimed.flushdb()
            self._claimed.close()
            self._claimed = None


def start_relay(listen: str, targets: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A relay (`relay.py`) in the root namespace; returns it and the `host:port` it listens on."""
    with log.open("ab") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hosts.relay", listen, *targets],
            cwd=ROOT,
            env=_quiet_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("listening "):
        stop_group(proc)
        raise RuntimeError(f"the relay to {targets} did not start: {log.read_text()[-1000:]}")
    return proc, line.split()[1]


@dataclass
class Cluster:
    """What `cluster()` started; see the module's docstring."""

    root: Path
    network: Network
    replicas: list[Replica]
    ledger_url: str
    """The ledger, as this (the root) namespace reaches it."""
    host_ledger_url: str
    """The ledger, as the hosts reach it (through the relay on the gateway)."""
    balancer: str
    """The load balancer's API URL (round robin over the replicas)."""
    services: subprocess.Popen
    server_env: dict[str, str]

    @property
    def hosts(self) -> list[Host]:
        return self.network.hosts

    @property
    def apis(self) -> list[str]:
        return [r.api for r in self.replicas]

    def require_hosts_apart(self) -> None:
        """Skip the calling test, with the reason, when the hosts are not namespaces apart."""
        if not self.network.apart:
            import pytest

            pytest.skip(f"hosts apart need network namespaces: {self.network.why_not}")

    def host_env(self, host: Host, api: str, **extra: str) -> dict[str, str]:
        """The environment of a process on `host` that talks to the API at `api`."""
        return _quiet_env(
            PREFECT_HOME=str(host.home),
            PREFECT_API_URL=api,
            PREFECT_GPU_BUDGET_LEDGER_URL=self.host_ledger_url,
            **extra,
        )

    def ensure_replicas(self) -> None:
        """Start again any replica a test killed, and wait until all answer."""
        for replica in self.replicas:
            if not replica.alive():
                replica.launch()
        for replica in self.replicas:
            replica.wait()

    def limit(self, scope: str, api: str) -> dict[str, Any] | None:
        """The global concurrency limit of `scope` as the replica at `api` reads it (None
        while it does not exist)."""
        from prefect_gpu_budget.admission.limits import limit_name

        name = urllib.parse.quote(limit_name(scope), safe="")
        try:
            return _http(f"{api}/v2/concurrency_limits/{name}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def active_slots(self, scope: str, api: str) -> int:
        found = self.limit(scope, api)
        return 0 if found is None else int(found["active_slots"])

    def wait_slots(self, scope: str, api: str, want: int, timeout: float, what: str) -> None:
        """Wait until `scope`'s limit, as the replica at `api` reads it, holds `want` slots;
        else fail with what could say why: every lease in Prefect's lease storage, the
        services' revocations and the hosts' warnings."""
        try:
            wait_until(lambda: self.active_slots(scope, api) == want, timeout, what, every=0.5)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {self.active_slots(scope, api)} slots, not {want}\n{self.slot_story()}"
            ) from None

    def slot_story(self) -> str:
        """What Prefect's leases were, for the message of a failed check of slots: each lease
        in Redis (its limits, slots, seconds left), the services' lines about leases, and the
        lines the hosts' processes wrote about their leases or heartbeats."""
        import redis

        env = self.server_env
        client = redis.Redis(
            host=env["PREFECT_REDIS_MESSAGING_HOST"],
            port=int(env["PREFECT_REDIS_MESSAGING_PORT"]),
            db=int(env["PREFECT_REDIS_MESSAGING_DB"]),
        )
        ids = {}
        for found in _http(f"{self.apis[0]}/v2/concurrency_limits/filter", {"limit": 200}):
            ids[found["id"]] = f"{found['name']}={found['active_slots']}/{found['limit']}"
        lines = ["leases:"]
        for key in sorted(client.scan_iter(match="*prefect:concurrency:lease:*")):
            lease = json.loads(client.get(key) or "null") or {}
            ends = lease.get("expiration")
            left = None if ends is None else round(_from_iso(ends) - time.time(), 1)
            limits = [ids.get(r, r) for r in lease.get("resource_ids", [])]
            lines.append(f"  {lease.get('id')} {lease.get('metadata')} {limits} left={left}")
        logs = [self.root / "services.log", *sorted(self.root.glob("agent-*.log"))]
        for log in logs:
            said = [
                line
                for line in log.read_text(errors="replace").splitlines()
                if re.search(r"lease|heartbeat|slots", line, re.IGNORECASE)
            ]
            lines += [f"{log.name}:", *(f"  {line[:300]}" for line in said[-40:])]
        return "\n".join(lines)

    def limits(self, api: str, prefix: str = "gpu-budget:") -> dict[str, tuple[int, int]]:
        """(active slots, limit) of every global concurrency limit named `prefix...`, as the
        replica at `api` reads them."""
        found = _http(f"{api}/v2/concurrency_limits/filter", {"limit": 200})
        return {
            c["name"]: (int(c["active_slots"]), int(c["limit"]))
            for c in found
            if c["name"].startswith(prefix)
        }


class ReplicaSlots:
    """What `audit` asks of the Prefect limits (`active_slots`), read from one replica."""

    def __init__(self, cluster: Cluster, api: str) -> None:
        self.cluster = cluster
        self.api = api

    def active_slots(self, scope: str) -> int | None:
        found = self.cluster.limit(scope, self.api)
        return None if found is None else int(found["active_slots"])


class PrivatePostgres:
    """A PostgreSQL cluster of the run's own (initdb in a temporary folder of its own, as the
    `postgres` user when run as root), listening on loopback and on `address`, trusting loopback
    and `subnet`: for a ledger the hosts reach with no relay in between (the benchmark's), and
    Prefect's database beside it, so that the gate and bare Prefect meet the same server."""

    def __init__(self, address: str, subnet: str | None) -> None:
        import pwd

        self.folder = Path(tempfile.mkdtemp(prefix="gpu-budget-hosts-pg-"))
        self.address = address
        self.subnet = subnet
        self.owner = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self.port = free_port(address)

    def _run(self, program: str, *args: str) -> None:
        done = subprocess.run(
            [_pg_program(program), *args],
            user=self.owner if os.geteuid() == 0 else None,
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if done.returncode != 0:
            log = self.folder / "postgres.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{program} {' '.join(args)}: {done.stderr.strip()}\n{tail}")

    def start(self) -> None:
        import pwd

        if os.geteuid() == 0:
            entry = pwd.getpwnam(self.owner)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        data = str(self.folder / "data")
        self._run("initdb", "-D", data, "-U", self.owner, "-A", "trust", "--no-sync", "-E", "UTF8")
        if self.subnet is not None:
            with (self.folder / "data" / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {self.subnet} trust\n")
        listen = ",".join(dict.fromkeys(["127.0.0.1", self.address]))
        options = f"-p {self.port} -k {self.folder} -c listen_addresses={listen}"
        options += " -c max_connections=200"
        self._run(
            "pg_ctl", "-D", data, "-l", str(self.folder / "postgres.log"), "-w", "-t", "120",
            "-o", options, "start",
        )  # fmt: skip

    def stop(self) -> None:
        """Stop it (immediate) and remove its folder."""
        if (self.folder / "data" / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run(
                    "pg_ctl", "-D", str(self.folder / "data"), "-w", "-m", "immediate", "stop"
                )
        shutil.rmtree(self.folder, ignore_errors=True)

    def database(self, name: str) -> str:
        """A new database `name` in it; its URL (psycopg) as this namespace reaches it."""
        url = f"postgresql+psycopg://{self.owner}@127.0.0.1:{self.port}"
        engine = sa.create_engine(f"{url}/postgres", isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return f"{url}/{name}"


def _pg_program(name: str) -> str:
    """A PostgreSQL server program: the newest installed version's, else PATH's."""
    import glob

    def version(path: str) -> tuple[int, ...]:
        folder = Path(path).parent.parent.name
        return tuple(int(part) for part in folder.split(".") if part.isdigit())

    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=version)
    program = found[-1] if found else shutil.which(name)
    if program is None:
        raise RuntimeError(f"PostgreSQL's {name} is needed for a private cluster: not found")
    return program


def _asyncpg(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql+asyncpg").render_as_string(False)


def _through(url: str, address: str) -> str:
    """`url` with its host and port replaced by `address` (`host:port`)."""
    host, _, port = address.rpartition(":")
    return sa.make_url(url).set(host=host, port=int(port)).render_as_string(False)


@contextlib.contextmanager
def cluster(
    root: Path,
    *,
    hosts: int,
    ledger_url: str | None = None,
    prefect_url: str | None = None,
    replicas: int = 2,
) -> Iterator[Cluster]:
    """Start everything of the module's docstring under `root` (logs there): `hosts` hosts,
    `replicas` API replicas on the PostgreSQL database `prefect_url`, the ledger `ledger_url`
    (both made by the caller, on a server that listens on loopback: the hosts reach it through
    a relay). Without them, both are databases of a `PrivatePostgres` that listens on the
    gateway too, which the hosts reach with no relay. Everything is stopped and removed when
    the block ends."""
    tag = secrets.token_hex(2)
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        network = Network(root, tag)
        stack.callback(network.close)
        network.open(hosts)
        direct = ledger_url is None or prefect_url is None
        if direct:
            subnet = f"{network.gateway.rsplit('.', 1)[0]}.0/24" if network.apart else None
            postgres = PrivatePostgres(network.gateway, subnet)
            stack.callback(postgres.stop)
            postgres.start()
            ledger_url, prefect_url = postgres.database("ledger"), postgres.database("prefect")
        redis_ = Redis(root, tag)
        stack.callback(redis_.close)
        redis_.open()
        env = _quiet_env(
            **server_settings(
                _asyncpg(prefect_url),
                redis_.host,
                redis_.port,
                redis_.messaging_db,
                redis_.docket_url,
            ),
            PREFECT_SERVER_DOCKET_NAME=f"gpu-budget-hosts-{tag}",
            PREFECT_HOME=str(root / "server-home"),
            PREFECT_LOGGING_LEVEL="INFO",
            PREFECT_SERVER_LOGGING_LEVEL="INFO",  # the repossessor's revocations, in its log
        )
        upgrade = subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=SERVER_START_S,
        )
        if upgrade.returncode != 0:
            raise RuntimeError(f"prefect server database upgrade: {upgrade.stdout[-3000:]}")
        started = []
        for index in range(replicas):
            home = root / f"replica{index}" / "home"
            home.mkdir(parents=True, exist_ok=True)
            own = {**env, "PREFECT_HOME": str(home)}
            if index > 0:  # one replica registers the block types: at once they race, and log
                own["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"] = "false"  # IntegrityErrors
            replica = Replica(index, network.gateway, home, own)
            stack.callback(replica.stop)
            replica.launch()
            started.append(replica)
        with (root / "services.log").open("w") as log:
            services = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "services", "start"],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        stack.callback(stop_group, services)
        if direct:
            host_ledger_url = _through(ledger_url, f"{network.gateway}:{postgres.port}")
        elif network.apart:  # the hosts reach PostgreSQL through a relay on the gateway
            pg = sa.make_url(ledger_url)
            relay, address = start_relay(
                f"{network.gateway}:0", [f"{pg.host}:{pg.port or 5432}"], root / "relays.log"
            )
            stack.callback(stop_group, relay)
            host_ledger_url = _through(ledger_url, address)
        else:
            host_ledger_url = ledger_url
        for replica in started:
            replica.wait()
        if services.poll() is not None:
            raise RuntimeError(f"services ended: {(root / 'services.log').read_text()[-3000:]}")
        balancer, address = start_relay(
            f"{network.gateway}:0",
            [f"{r.address}:{r.port}" for r in started],
            root / "relays.log",
        )
        stack.callback(stop_group, balancer)
        stack.callback(lambda: [host.stop() for host in network.hosts])  # first: the clients
        yield Cluster(
            root=root,
            network=network,
            replicas=started,
            ledger_url=ledger_url,
            host_ledger_url=host_ledger_url,
            balancer=f"http://{address}/api",
            services=services,
            server_env=env,
        )


# -- agents ------------------------------------------------------------------------------------

AGENT_DEFAULTS: dict[str, Any] = {
    "instance_type": "local:hosts",
    "jobs": 1,
    "threads": 1,
    "job_s": 0.3,
    "max_runtime": "60s",
    "max_wait": "120s",
    "heartbeat_s": 1.0,
    "recheck_s": 1.0,
    "wait_for_go": False,
}
"""An agent's job settings unless a test says otherwise: short clocks, so that a host silent
for a few seconds is far past many missed beats (tests/hosts/agent.py)."""


class Agent:
    """An agent process (tests/hosts/agent.py) on a host, its JSON lines collected as they come."""

    def __init__(self, host: Host, proc: subprocess.Popen, log: Path) -> None:
        import threading

        self.host = host
        self.proc = proc
        self.log = log
        self.lines: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(ValueError):
                line = json.loads(raw)
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def events(self, name: str) -> list[dict[str, Any]]:
        with self._changed:
            return [line for line in self.lines if line["e"] == name]

    def wait_for(self, name: str, count: int = 1, timeout: float = 180.0) -> list[dict[str, Any]]:
        """Wait until the agent said `name` `count` times; fail with its log if it ends first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self.lines if line["e"] == name]
                if len(found) >= count:
                    return found
                if self.errors() or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"agent on {self.host.name} ended: {self.tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"agent on {self.host.name}: no {count} {name}; {self.tail()}"
                    )
                self._changed.wait(1.0)

    def errors(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["e"] == "error"]

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 180.0) -> list[dict[str, Any]]:
        """Wait for the agent's end (exit 0 and `done`); its lines."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent on {self.host.name} still runs: {self.tail()}") from None
        self._reader.join(timeout=30)
        assert code == 0 and self.events("done"), f"agent on {self.host.name}: {self.tail()}"
        return self.lines

    def tail(self) -> str:
        said = [line for line in self.lines if line["e"] in ("error", "refused")][-3:]
        return f"{said} {self.log.read_text(errors='replace')[-2000:]}"


def start_agent(cluster: Cluster, host: Host, api: str, prices: Path, **config: Any) -> Agent:
    """An agent on `host` whose Prefect API is `api` (a replica, or the load balancer)."""
    settings = {
        **AGENT_DEFAULTS,
        **config,
        "ledger_url": cluster.host_ledger_url,
        "prices": str(prices),
    }
    log = cluster.root / f"agent-{host.name}-{len(host.procs)}.log"
    proc = host.start(
        [sys.executable, "-m", "tests.hosts.agent", json.dumps(settings)],
        cluster.host_env(host, api, PREFECT_GPU_BUDGET_PRICES=str(prices)),
        log,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return Agent(host, proc, log)


def cli(cluster: Cluster, host: Host, api: str, prices: Path, *args: str) -> Any:
    """`prefect-gpu-budget ARGS` run on `host` against the API at `api`; its CompletedProcess."""
    script = Path(sys.executable).with_name("prefect-gpu-budget")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "prefect_gpu_budget.cli"]
    env = cluster.host_env(host, api, PREFECT_GPU_BUDGET_PRICES=str(prices))
    return host.run([*command, *args], env, timeout=180)
