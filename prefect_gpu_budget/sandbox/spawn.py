"""How the job holder (`holder.py`) starts the command: as whom, where, within which limits,
and in which namespaces.

- `Child`: the command's user, umask, folder, environment and resource limits, and the walls
  it gets (`--keep`, `--tmp-size`, Landlock);
- `spawn`: fork and exec the command as `Child` says, after the switch of user;
- `new_pid_namespace` and `spawn_init`: the job's own PID namespace, whose pid 1 starts the
  command, reaps what ends in it and reports the command's wait status;
- `isolate_init` (in that pid 1, for `--isolate`): its own network, IPC and mount namespaces
  behind the walls of `walls.py`, with `/proc` for its PID namespace;
- `spawn_relay`: the relay of `--proxy` (`relay.py`), the isolated job's one way out.

Like the holder, it imports only the standard library and is loaded by its path (`sibling`):
the holder runs as a file with `-I`, so neither this package nor this folder is on sys.path.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
ISOLATION_REFUSED = 125
"""The holder's exit code when `--isolate` cannot be had: the command never started."""
PROXY_PORT = 3128
"""Where, on the job's own loopback, `--proxy`'s relay listens."""
RESET_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ") if hasattr(signal, name)
)
"""What Python ignores and the command gets back at their defaults (as `subprocess` does)."""


def prctl(option: int, value: int) -> bool:
    """Linux `prctl(option, value)`: whether it was done (False off Linux)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no subreaper, direct children only
        return False
    return call(option, value, 0, 0, 0) == 0


def sibling(name: str):
    """A module beside this file (`walls`, `sockets`, `relay`), loaded by its path: the holder
    runs as a file with `-I`, so neither this package nor this folder is on sys.path."""
    import importlib.util

    loaded = sys.modules.get(f"_gpu_budget_holder_{name}")
    if loaded is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_gpu_budget_holder_{name}", path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded
        spec.loader.exec_module(loaded)
    return loaded


class Child:
    """How the command is started: as whom, where, with which environment (None: the holder's
    own, as it is), within which resource limits (`(RLIMIT_*, value)`)."""

    def __init__(
        self,
        user: tuple[int, int] | None = None,
        umask: int | None = None,
        cwd: str | None = None,
        env: dict[bytes, bytes] | None = None,
        limits: list[tuple[int, int]] | None = None,
    ) -> None:
        self.user, self.umask, self.cwd, self.env = user, umask, cwd, env
        self.limits = list(limits or ())
        self.keep: list[str] = []
        """Read-only paths the job needs that lie in a folder it gets a private one of
        (its interpreter, its code): bound back in (`--keep`)."""
        self.tmp_size: int | None = None
        """The most its private folders may hold together (`--tmp-size`, the disk cap)."""
        self.landlock: int | None = None
        """A Landlock ruleset the command is confined by (`walls.landlock_ruleset`)."""
        self.isolated = False
        """Whether the command starts behind the walls set on its own process (no kernel
        keys, Landlock): `isolate_init` made the rest."""


def _bound(limits: list[tuple[int, int]]) -> None:  # pragma: no cover - runs in the child
    """Set each limit, soft and hard, to its value, or to the hard limit there is if that is
    lower (so it only ever lowers what the process may raise itself to)."""
    for which, value in limits:
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def _exec_with(command: list[str], env: dict[bytes, bytes]) -> None:  # pragma: no cover
    """`os.execvpe`, looked up on `env`'s PATH, without the imports `os.execvpe` makes (after
    a switch of user the standard library may be out of reach)."""
    name = os.fsencode(command[0])
    if b"/" in name:
        os.execve(name, command, env)
    error: OSError = FileNotFoundError(2, "No such file or directory", command[0])
    for folder in env.get(b"PATH", os.defpath.encode()).split(b":"):
        try:
            os.execve(os.path.join(folder or b".", name), command, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:  # e.g. permission denied: remembered, as execvp does
            error = exc
    raise error


def _switch_user(user: tuple[int, int]) -> None:  # pragma: no cover - runs in the child
    """Become `user` (uid, gid), with no supplementary groups and no new privileges."""
    uid, gid = user
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
        raise PermissionError(f"could not switch to uid {uid}, gid {gid}")
    # no setuid or setgid program gains it anything: crontab and at (which would run its
    # work outside this tree, unbilled, for ever), sudo, su, pkexec
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise PermissionError("could not set no_new_privs")


def _set_walls(child: Child) -> None:  # pragma: no cover - runs in the child
    """The walls set on the job's own process, after the switch: no new privileges, no
    kernel keys, and Landlock where `isolate_init` made a ruleset."""
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise PermissionError("could not set no_new_privs")
    walls = sibling("walls")
    walls.forbid_keys()
    if child.landlock is not None:
        walls.landlock_restrict(child.landlock)


def _start(
    command: list[str], mask: set[int], child: Child, parent: int
) -> None:  # pragma: no cover
    """In the forked child of `parent` (the holder, or the job's pid 1): become what `child`
    says, then exec the command."""
    if child.user is not None:  # 1. the job's user
        _switch_user(child.user)
    if child.isolated:  # 2. the walls set on its own process
        _set_walls(child)
    if child.umask is not None:  # 3. its umask and folder
        os.umask(child.umask)
    if child.cwd is not None:
        os.chdir(child.cwd)
    _bound(child.limits)  # 4. its limits, after the switch: the holder stays unbounded
    for sig in RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    # 5. its parent-death signal, after the switch: a change of user clears it
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the holder died before that took effect
        os._exit(137)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if child.env is None:  # 6. the command
        os.execvp(command[0], command)
    else:
        _exec_with(command, child.env)


def spawn(command: list[str], mask: set[int], child: Child) -> int:
    """Fork the command as `child` says (the signal mask `mask` restored in it); its pid."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _start(command, mask, child, parent)
        except BaseException as exc:  # noqa: BLE001 - report and leave, whatever it was
            os.write(2, f"could not start {command[0]!r}: {exc}\n".encode())
        os._exit(127)
    return pid


def _unshare(flags: int) -> str:
    """Move this process into new namespaces (`CLONE_NEW*`): '' when done, else why not."""
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError):
        return "no namespaces on this system"
    if unshare(flags) == 0:
        return ""
    return os.strerror(ctypes.get_errno()) or "refused"


def new_pid_namespace(isolate: bool = False) -> str:
    """Whether the next process this one forks starts a PID namespace of its own: '' if so,
    else why not. With `isolate` and no root, in a user namespace of this process's own
    that maps its uid and gid to themselves (so its children may make the other namespaces
    `isolate_init` makes, and the job keeps the holder's uid)."""
    if not isolate or os.geteuid() == 0:
        return _unshare(CLONE_NEWPID)
    uid, gid = os.geteuid(), os.getegid()
    why = _unshare(CLONE_NEWUSER | CLONE_NEWPID)
    if why:
        return f"no user namespace for a worker that is not root ({why})"
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        with open("/proc/self/gid_map", "w") as handle:
            handle.write(f"{gid} {gid} 1")
    except OSError as exc:
        return f"could not map the worker's user into its namespace ({exc.strerror})"
    return ""


def _loopback_up() -> None:
    """Bring up the namespace's own loopback (a new network namespace starts with it down)."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        asked = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, siocgifflags, asked)[:18])[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))


def isolate_init(relay: int | None, child: Child) -> None:  # pragma: no cover - in pid 1
    """In the job's pid 1, before the command starts: a network namespace of its own (its own
    loopback up, nothing else), an IPC namespace of its own (no SysV or POSIX segment of the
    host or another job, none outliving it), a mount namespace of its own whose mounts do not
    reach back to the host's, with `/proc` for its PID namespace and the walls of `walls.py`
    (its own /run, /tmp, /var/tmp and /dev/shm; no socket of the host; Landlock, where the
    kernel has it, set in `child` for the command); with `relay` (a socket to the holder's
    relay), a listener on the job's 127.0.0.1:PROXY_PORT handed to it. Raises OSError saying
    what failed."""
    walls = sibling("walls")
    sockets = sibling("sockets").host_sockets()  # the host's, from the host's namespaces
    why = _unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC)
    if why:
        raise OSError(f"no network, IPC and mount namespace of its own here ({why})")
    walls.mount(None, "/", None, MS_REC | MS_PRIVATE)
    walls.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    walls.bound_ipc(child.tmp_size)
    writable = [child.cwd] if child.cwd else []
    walls.private_dirs(child.tmp_size, child.keep, writable)
    walls.mask_sockets(sockets)
    own = [*writable, "/run", *(host for host, _ in walls.PRIVATE_BINDS)]
    child.landlock, _ = walls.landlock_ruleset(own, ["/dev", "/proc"])
    child.isolated = True
    _loopback_up()
    if relay is not None:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", PROXY_PORT))
            listener.listen(64)
            with socket.socket(fileno=relay) as channel:
                socket.send_fds(channel, [b"L"], [listener.fileno()])


def _init(  # pragma: no cover - pid 1 of the namespace
    command: list[str], mask: set[int], child: Child, report: int, isolate: bool, relay: int | None
) -> None:
    """The life of the job's pid 1: its walls (with `isolate`), the command, every process
    that ends in the namespace reaped, the command's wait status written to `report`."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if isolate:
        try:
            isolate_init(relay, child)
        except OSError as exc:
            refused = f"could not start {command[0]!r}: isolation refused: {exc}\n"
            os.write(2, refused.encode())
            os._exit(ISOLATION_REFUSED)
    job = spawn(command, mask, child)
    while True:
        try:
            done, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if done == job:  # at once: the init may yet be killed for what the job left
            os.write(report, wait_status.to_bytes(4, "little"))


def spawn_init(
    command: list[str],
    mask: set[int],
    child: Child,
    report: int,
    isolate: bool = False,
    relay: int | None = None,
) -> int:
    """Fork pid 1 of the job's own PID namespace (`new_pid_namespace` first): it starts the
    command, writes its wait status to `report` when it ends, reaps every process that ends in
    the namespace, and leaves once none is left. When it ends, SIGKILLed included, the
    kernel kills every process left in the namespace at once, so no chain of forks can outrun
    the stop as one can outrun a walk of /proc. Signals the holder sends the tree stay
    pending in it (they are blocked, and pid 1 takes no default action from its own
    namespace's processes), so it lives until its namespace is empty or it is SIGKILLed.
    With `isolate`, it first makes the rest of the job's walls (`isolate_init`), and leaves
    with ISOLATION_REFUSED, the command never started, if it cannot."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - pid 1 of the namespace
        try:
            _init(command, mask, child, report, isolate, relay)
        except BaseException:  # noqa: BLE001 - leave whatever it was; the holder sees it
            os._exit(127)
        os._exit(0)
    return pid


def spawn_relay(channel: int, target: tuple[str, int], user: tuple[int, int] | None) -> int:
    """Fork the relay of `--proxy` (`relay.py`) before the job's PID namespace is made, so
    the job sees it in none of its /proc: on the holder's network, as the job's `user`, it
    takes the listener the job's pid 1 hands over `channel` and carries each connection made
    to it to `target`. It dies with the holder."""
    relay = sibling("relay")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the relay
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            relay.serve(channel, target, user)
        except BaseException as exc:  # noqa: BLE001 - say it, then leave
            os.write(2, f"job holder: the proxy relay stopped: {exc!r}\n".encode())
        finally:
            os._exit(0)
    os.close(channel)
    return pid
