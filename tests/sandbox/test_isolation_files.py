"""An agent's job reaches nothing of its host, round two (`sandbox/walls.py`, the holder's
`--isolate`): real jobs, as `nobody`, trying from inside what a hostile trial would: the unix
socket of a PostgreSQL that trusts local users, any 0777 socket of the host, /run/lock, SysV
and POSIX shared memory, an unlinked file past the disk cap; on both network modes that
confine (`none` and a proxy). Each attack is first shown to work on the host's network
(`host`), so the test can fail.

Namespaces, mounts and users need a root worker (as CI runs); these tests skip otherwise.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.sandbox.launcher import Sandbox
from tests.sandbox.sandboxed import box_quote, open_folder, run_job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and users need root")

CONNECT = (
    "import socket, sys\n"
    "for i, path in enumerate(sys.argv[1:]):\n"
    "    sock = socket.socket(socket.AF_UNIX)\n"
    "    try:\n"
    "        sock.connect(path)\n"
    "        print('reached', i)\n"
    "    except OSError as exc:\n"
    "        print('refused', i, type(exc).__name__)\n"
)
"""A trial that connects to each unix socket path it is given, and says which it reached (by
its place among them)."""


def _attack(base: Path, quote, network: str, paths: list[str]) -> None:
    """Connect to each of `paths` from a job on the host's network (each is reached: the attack
    works) and from a job on `network` (none is)."""
    command = ["python3", "-c", CONNECT, *paths]
    opened = Sandbox(user="nobody", root=base / "jobs", network="host")
    result, lines = run_job(opened, quote, command)
    assert result.outcome == "completed", (result, lines)
    assert [f"reached {i}" for i in range(len(paths))] == lines, (paths, lines)
    box = Sandbox(user="nobody", root=base / "jobs", network=network)
    result, lines = run_job(box, quote, command)
    assert result.outcome == "completed", (result, lines)
    assert [x.split()[0] for x in lines] == ["refused"] * len(paths), (paths, lines)


@pytest.fixture
def base() -> Iterator[Path]:
    with open_folder("gpu-walls-test-") as path:
        yield path


@pytest.fixture
def outside() -> Iterator[Path]:
    """A folder of the host in none of the folders a job gets a private one of, open to all:
    only the covering of the host's sockets keeps a job from what is bound there."""
    with open_folder("gpu-walls-test-", parent="/var/lib") as path:
        yield path


@pytest.fixture
def quote(prices: Path):
    return box_quote(prices)


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    """An admin's proxy (it only holds what it is sent): the proxy network mode's URL."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        held: list[socket.socket] = []

        def accept() -> None:
            while True:
                try:
                    held.append(server.accept()[0])
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
        for conn in held:
            conn.close()


@pytest.fixture(params=["none", "proxy"])
def network(request, proxy: str) -> str:
    return proxy if request.param == "proxy" else "none"


def _serve_unix(path: Path) -> socket.socket:
    """A unix socket any user may connect to (0777), as a test server or MariaDB leaves."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    os.chmod(path, 0o777)
    server.listen(8)
    return server


@pytest.fixture(scope="module")
def trusting_postgres() -> Iterator[Path]:
    """A PostgreSQL of this test's own that trusts every local user, its socket (0777) in a
    folder of the host outside /run and /tmp that any user may pass: the path to its socket."""
    from tests.support.postgres import private_cluster

    with private_cluster(parent="/var/lib") as cluster:
        os.chmod(cluster.folder, 0o755)
        yield cluster.folder / f".s.PGSQL.{cluster.port}"


def test_no_socket_of_the_host_is_reached_from_any_path(
    base, outside, quote, network, trusting_postgres
):
    """PostgreSQL's socket with `trust` for local users (CREATE TABLE as `postgres` was the
    attack), and a 0777 socket in /tmp, in /run, in a folder of the host outside both and
    through a second mount of that folder: on the host's network each is reached, from the job
    none is."""
    token = uuid.uuid4().hex[:8]
    (outside / "served").mkdir(mode=0o755)
    (outside / "alias").mkdir(mode=0o755)
    servers = [
        _serve_unix(Path(f"/tmp/gpu-walls-{token}.sock")),
        _serve_unix(Path(f"/run/gpu-walls-{token}.sock")),
        _serve_unix(outside / "served" / "service.sock"),
    ]
    # the same folder bound at a second path: /proc/net/unix names only the first
    subprocess.run(["mount", "--bind", outside / "served", outside / "alias"], check=True)
    paths = [str(trusting_postgres), *(s.getsockname() for s in servers)]
    paths.append(str(outside / "alias" / "service.sock"))
    paths += [
        str(Path(p).resolve()) for p in ("/var/run/postgresql/.s.PGSQL.5432",) if Path(p).exists()
    ]
    try:
        _attack(base, quote, network, paths)
    finally:
        subprocess.run(["umount", outside / "alias"], check=False)
        for server in servers:
            os.unlink(server.getsockname())
            server.close()


SERVE = (
    "import os, socket, sys\n"
    "server = socket.socket(socket.AF_UNIX)\n"
    "server.bind(sys.argv[1])\n"
    "os.chmod(sys.argv[1], 0o777)\n"
    "server.listen(8)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    server.accept()[0].close()\n"
)
"""A 0777 unix socket server at the path it is given, relative to its folder or not."""


def _serve_from(command: list[str], path: str, cwd: Path | None = None) -> subprocess.Popen:
    """A socket server (`SERVE`) started by `command` (`unshare -n`, say), once it listens."""
    server = subprocess.Popen(
        [*command, sys.executable, "-c", SERVE, path], cwd=cwd, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline() == "ready\n", server.poll()
    return server


def test_a_socket_bound_in_other_namespaces_or_by_other_paths_is_not_reached(
    base, outside, quote, network
):
    """What /proc/net/unix does not name as the job sees it: a socket of a server with a
    network of its own; one bound in a mount namespace of its own (at a path bound there
    only); one bound by a relative path; one under a path with a newline; and every socket of
    /run through a second mount of /run (the job's own /run hides the first)."""
    token = uuid.uuid4().hex[:8]
    for folder in ("own-net", "own-mounts", "seen-there", "relative", "new\nline", "run"):
        (outside / folder).mkdir(mode=0o755)
    script = f'mount --bind {outside / "own-mounts"} {outside / "seen-there"} && exec "$@"'
    servers = [
        _serve_from(["unshare", "-n"], str(outside / "own-net" / "s.sock")),
        _serve_from(["unshare", "-m", "sh", "-c", script, "-"], str(outside / "seen-there/s.sock")),
        _serve_from([], "s.sock", cwd=outside / "relative"),
        _serve_from([], str(outside / "new\nline" / "s.sock")),
        _serve_from([], f"/run/gpu-walls-{token}.sock"),
    ]
    subprocess.run(["mount", "--bind", "/run", outside / "run"], check=True)
    paths = [
        str(outside / folder / "s.sock")
        for folder in ("own-net", "own-mounts", "relative", "new\nline")
    ]
    paths.append(str(outside / "run" / f"gpu-walls-{token}.sock"))
    try:
        _attack(base, quote, network, paths)
    finally:
        subprocess.run(["umount", outside / "run"], check=False)
        for server in servers:
            server.kill()
            server.wait()
        os.unlink(f"/run/gpu-walls-{token}.sock")


LEAVE = (
    "import ctypes, os, sys\n"
    "token = sys.argv[1]\n"
    "for folder in ('/tmp', '/var/tmp', '/dev/shm', '/run/lock'):\n"
    "    with open(f'{folder}/gpu-walls-{token}', 'w') as f:\n"
    "        f.write('left')\n"
    "print('host files seen', sorted(n for n in os.listdir('/dev/shm') if 'host' in n))\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "print('host segment', libc.shmget(int(sys.argv[2]), 0, 0))\n"
    "mine = libc.shmget(int(sys.argv[3]), 64 << 20, 0o1666)  # IPC_CREAT, 0666\n"
    "print('own segment', mine >= 0)\n"
)
"""A trial that leaves a file in each temporary folder any user may write, looks for the
host's POSIX segment and SysV segment, and makes a 64 MiB SysV segment of its own."""


def _shm_keys() -> set[int]:
    with open("/proc/sysvipc/shm") as handle:
        next(handle)
        return {int(line.split()[0]) for line in handle}


def test_nothing_of_the_host_is_seen_and_nothing_outlives_the_job(base, quote, network):
    """/tmp, /var/tmp, /dev/shm and /run/lock are the job's own and gone with it; the host's
    POSIX and SysV shared memory is not seen, and the job's own SysV segment goes with it."""
    token = uuid.uuid4().hex[:8]
    host_key, job_key = (int(uuid.uuid4().hex[:7], 16) for _ in range(2))
    libc = ctypes.CDLL(None, use_errno=True)
    host_segment = libc.shmget(host_key, 4096, 0o1666)
    assert host_segment >= 0
    host_file = Path(f"/dev/shm/gpu-walls-host-{token}")
    host_file.write_text("host")
    host_file.chmod(0o666)
    left = [Path(f"{d}/gpu-walls-{token}") for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")]
    try:
        box = Sandbox(user="nobody", root=base / "jobs", network=network)
        command = ["python3", "-c", LEAVE, token, str(host_key), str(job_key)]
        result, lines = run_job(box, quote, command)
        assert result.outcome == "completed", (result, lines)
        assert "host files seen []" in lines, lines
        assert "host segment -1" in lines and "own segment True" in lines, lines
        assert not [p for p in left if p.exists()], lines
        assert job_key not in _shm_keys()
    finally:
        libc.shmctl(host_segment, 0, None)  # IPC_RMID
        host_file.unlink()
        for path in left:
            path.unlink(missing_ok=True)


HOLD_UNLINKED = (
    "import os, time\n"
    "f = open('big', 'wb')\n"
    "os.unlink('big')\n"
    "for _ in range(40):\n"
    "    f.write(b'x' * (1 << 20))\n"
    "f.flush()\n"
    "print('holding', flush=True)\n"
    "time.sleep(60)\n"
)
"""A trial that writes 40 MiB to a file it has unlinked, and holds it open."""


def test_an_unlinked_file_held_open_counts_against_the_disk_cap(base, quote, network):
    box = Sandbox(user="nobody", root=base / "jobs", network=network, limits={"disk": "20M"})
    started = time.monotonic()
    result, lines = run_job(box, quote, ["python3", "-c", HOLD_UNLINKED], max_runtime="2m")
    assert "holding" in lines, (result, lines)
    assert result.outcome != "completed", (result, lines)
    assert "past its disk limit" in (result.detail or ""), result
    assert time.monotonic() - started < 45, result  # stopped at a check, not at its end


FILL_TMP = (
    "import os\n"
    "try:\n"
    "    with open('/dev/shm/fill', 'wb') as f:\n"
    "        for _ in range(64):\n"
    "            f.write(b'x' * (1 << 20))\n"
    "    print('wrote 64 MiB')\n"
    "except OSError as exc:\n"
    "    print('refused', exc.strerror)\n"
)


SYSV_FILL = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "made = [libc.shmget(0, 8 << 20, 0o1600) for _ in range(8)]  # IPC_PRIVATE, IPC_CREAT\n"
    "print('segments', sum(m >= 0 for m in made))\n"
    "print('one of 64 MiB', libc.shmget(0, 64 << 20, 0o1600) >= 0)\n"
)
"""A trial that asks for 8 SysV segments of 8 MiB, then one of 64 MiB."""


def test_the_private_folders_hold_no_more_than_the_disk_cap(base, quote, network):
    """/dev/shm past the cap is full; SysV shared memory (memory no folder shows) is bounded
    the same: a new IPC namespace would otherwise allow all but unlimited segments."""
    box = Sandbox(user="nobody", root=base / "jobs", network=network, limits={"disk": "16M"})
    result, lines = run_job(box, quote, ["python3", "-c", FILL_TMP])
    assert "refused No space left on device" in lines, (result, lines)
    result, lines = run_job(box, quote, ["python3", "-c", SYSV_FILL])
    assert "one of 64 MiB False" in lines, (result, lines)
    assert "segments 8" not in lines, (result, lines)  # shmall: 16 MiB in all


FLOOD = (
    "import os, socket, time\n"
    "held = []\n"
    "for _ in range(1000):\n"
    "    sock = socket.socket()\n"
    "    sock.setblocking(False)\n"
    "    sock.connect_ex(('127.0.0.1', 3128))\n"
    "    held.append(sock)\n"
    "ports = set()\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    for table in ('tcp', 'tcp6'):\n"
    "        try:\n"
    "            rows = open(f'/proc/{pid}/net/{table}').read().splitlines()[1:]\n"
    "        except OSError:\n"
    "            continue\n"
    "        ports |= {int(r.split()[1].rsplit(':', 1)[1], 16) for r in rows}\n"
    "print('ports seen', sorted(ports))\n"
    "print('flooding', flush=True)\n"
    "time.sleep(10)\n"
)
"""A trial that opens 1,000 connections to its relay at once, lists every TCP port any /proc
it can read shows, and holds the connections for 10 s."""


def _parent(pid: str) -> str:
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1].decode()


def _relays(user: str) -> list[int]:
    """The processes of this test's job holders (started by this process) that run as
    `user`: the relay. (Other tests may run jobs as `user` meanwhile.)"""
    uid = pwd.getpwnam(user).pw_uid
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            if b"holder.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            if _parent(_parent(pid)) == str(os.getpid()):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_the_relay_is_bounded_and_none_of_its_proc_is_the_jobs(base, quote, proxy):
    """1,000 connections at once: the relay (the job's user, one thread) carries at most
    MAX_CONNECTIONS, holds a bounded number of descriptors, and the job reads no /proc of it
    (its net/tcp listed every listening port of the host)."""
    from prefect_gpu_budget.sandbox import relay as relay_module

    host_port = int(proxy.rsplit(":", 1)[1])
    box = Sandbox(user="nobody", root=base / "jobs", network=proxy)
    lines: list[str] = []
    spec = GpuJob(instance_type="local:box", command=["python3", "-c", FLOOD], max_runtime="1m")
    launcher = LocalLauncher(box)
    done: list[object] = []
    runner = threading.Thread(
        target=lambda: done.append(launcher.run(spec, quote, log=lines.append))
    )
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while "flooding" not in lines and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.1)
        assert "flooding" in lines, (done, lines)
        time.sleep(1)
        relays = _relays("nobody")
        assert len(relays) == 1, relays
        relay = relays[0]
        assert len(os.listdir(f"/proc/{relay}/task")) == 1  # one thread
        fds = len(os.listdir(f"/proc/{relay}/fd"))
        assert fds <= 2 * relay_module.MAX_CONNECTIONS + 16, fds
        seen = next(x for x in lines if x.startswith("ports seen"))
        assert (
            str(host_port) not in seen.replace("[", " ").replace("]", " ").replace(",", " ").split()
        ), seen
    finally:
        runner.join(timeout=90)


KEYS = (
    "import ctypes, platform\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "calls = {'x86_64': (248, 250), 'aarch64': (217, 219)}[platform.machine()]\n"
    "key = libc.syscall(calls[0], b'user', b'left-for-later', b'data', 4, -4)  # user keyring\n"
    "print('add_key', key, ctypes.get_errno())\n"
    "print('keyctl', libc.syscall(calls[1], 0, -4, 0, 0, 0), ctypes.get_errno())\n"
)
"""A trial that leaves a key in its user's keyring (which outlives it, for the next job of its
user to read), and asks for that keyring's id."""


def test_a_job_can_leave_nothing_in_its_users_kernel_keyrings(base, quote, network):
    box = Sandbox(user="nobody", root=base / "jobs", network=network)
    result, lines = run_job(box, quote, ["python3", "-c", KEYS])
    assert result.outcome == "completed", (result, lines)
    assert lines == ["add_key -1 1", "keyctl -1 1"], lines  # EPERM, both
