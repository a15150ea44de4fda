"""The job holder: a tiny process between the launcher and the job's command.

A local job is the whole process tree its command starts, not just the command: a command that
starts `nohup train &` or `setsid train &` and exits at once must not be settled at $0 while
its children go on using the GPUs. This holder

- makes itself a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so every orphaned descendant,
  even one in a new session or process group, is reparented to it rather than to init;
- starts the command, reaps every process that ends under it, and exits only when none is
  left, with the command's exit status (its exit code, or the signal that killed it);
- on SIGTERM (or SIGINT) stops the whole tree: SIGTERM to every descendant, then SIGKILL to any
  still there after the grace period;
- kills the whole tree at once when the launcher's thread dies (parent-death signal).

It runs as a file, `python -I -S _reaper.py --grace S --holder PID -- command...`, and imports
only the standard library, so it starts in milliseconds. The subreaper setting stays in this
process; the launcher's own process (and its other jobs) is untouched.

For an agent's job (`sandbox.py`) the holder stays with the launcher's user (root, so that the
job cannot kill or trace it) and starts the command as another: `--user UID:GID` (no
supplementary groups), `--umask 077`, `--cwd DIR` (entered after the switch). `--env-stdin`
reads the command's environment from stdin (`NAME=value` entries, NUL-separated, until EOF):
the holder itself then runs with the launcher's minimal environment, never one the job chose
(`LD_PRELOAD` in a root process), and stdin is /dev/null for the command. `--own-pids` starts
it in a PID namespace of its own, so that its end at a stop takes every process of it at once,
however fast they fork (`_spawn_init`). `--isolate` goes further, for an agent's job (`isolate`),
and refuses to start the command (exit code ISOLATION_REFUSED, one line) where the kernel will not:
the command gets, beside its own PID namespace, a network namespace of its own (only its own
loopback: no address of the host, the host's loopback included, is reachable), an IPC namespace
of its own, and a mount namespace with `/proc` mounted for its PID namespace (it sees its own
processes only, not the host's command lines and environments) behind the walls of `_walls.py`:
its own /run, /tmp, /var/tmp and /dev/shm (one tmpfs of at most `--tmp-size` bytes; its `--cwd`
and each `--keep PATH` it reads are bound back in where they lie below one of them), every
host socket covered, and Landlock where the kernel has it. `--proxy HOST:PORT` (with
`--isolate`) is the one way out: a relay (`_relay.py`), forked before the job's PID namespace is
made and run as the job's user, takes a listener on the job's own 127.0.0.1:PROXY_PORT and
carries each connection to HOST:PORT (the admin's HTTP(S) proxy), opened from the holder's
network. Without root, the namespaces are made in a user namespace of the holder's own, the job
keeping the holder's uid. `--probe` only tells (exit 0, or ISOLATION_REFUSED with the reason)
whether `--isolate` can be had here. `--rlimit NAME=N` (`nproc`, `nofile`, `fsize`, `as`;
repeatable) bounds the command and everything it starts:
set, soft and hard alike (never above the holder's own hard limit), in the command's process
after the switch of user, so the holder itself is never bounded by them and can always stop
the tree.

The command starts with SIGPIPE and SIGXFSZ at their defaults (Python, which the holder is,
ignores both, and an ignored signal stays ignored across `exec`): a job writing past its file
size limit is stopped by SIGXFSZ, as it would be started from a shell.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys
import time

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
WATCHED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Blocked and taken with sigtimedwait: no handler ever runs at an awkward moment."""
HOLDER_GONE = signal.SIGUSR1
"""This process's parent-death signal: the launcher's thread died, kill everything now."""
RLIMITS = {
    "nproc": resource.RLIMIT_NPROC,
    "nofile": resource.RLIMIT_NOFILE,
    "fsize": resource.RLIMIT_FSIZE,
    "as": resource.RLIMIT_AS,
}
"""The limits `--rlimit NAME=N` sets on the command."""
RESET_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ") if hasattr(signal, name)
)
"""What Python ignores and the command gets back at their defaults (as `subprocess` does)."""


def _prctl(option: int, value: int) -> bool:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no subreaper, direct children only
        return False
    return prctl(option, value, 0, 0, 0) == 0


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _signal_tree(sig: int) -> None:
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


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
        """A Landlock ruleset the command is confined by (`_walls.landlock_ruleset`)."""
        self.isolated = False
        """Whether the command starts behind the walls set on its own process (no kernel
        keys, Landlock): `_isolate_init` made the rest."""


def _sibling(name: str):
    """A module beside this file (`_walls`, `_relay`), loaded by its path: the holder runs
    as a file with `-I`, so neither this package nor this folder is on sys.path."""
    import importlib.util

    loaded = sys.modules.get(f"_gpu_budget_holder_{name}")
    if loaded is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_gpu_budget_holder_{name}", path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded
        spec.loader.exec_module(loaded)
    return loaded


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


def _spawn(command: list[str], mask: set[int], child: Child) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            if child.user is not None:
                uid, gid = child.user
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
                    raise PermissionError(f"could not switch to uid {uid}, gid {gid}")
                # no setuid or setgid program gains it anything: crontab and at (which would
                # run its work outside this tree, unbilled, for ever), sudo, su, pkexec
                if not _prctl(PR_SET_NO_NEW_PRIVS, 1):
                    raise PermissionError("could not set no_new_privs")
            if child.isolated:  # the walls set on the job's own process, after the switch
                if not _prctl(PR_SET_NO_NEW_PRIVS, 1):
                    raise PermissionError("could not set no_new_privs")
                walls = _sibling("_walls")
                walls.forbid_keys()
                if child.landlock is not None:
                    walls.landlock_restrict(child.landlock)
            if child.umask is not None:
                os.umask(child.umask)
            if child.cwd is not None:
                os.chdir(child.cwd)
            _bound(child.limits)  # after the switch: the holder stays unbounded
            for sig in RESET_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            # After the switch: a change of user clears the parent-death signal.
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the holder died before that took effect
                os._exit(137)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if child.env is None:
                os.execvp(command[0], command)
            else:
                _exec_with(command, child.env)
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


def _new_pid_namespace(isolate: bool = False) -> str:
    """Whether the next process this one forks starts a PID namespace of its own: '' if so,
    else why not. With `isolate` and no root, in a user namespace of this process's own
    that maps its uid and gid to themselves (so its children may make the other namespaces
    `_isolate_init` makes, and the job keeps the holder's uid)."""
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


def _isolate_init(relay: int | None, child: Child) -> None:  # pragma: no cover - in pid 1
    """In the job's pid 1, before the command starts: a network namespace of its own (its own
    loopback up, nothing else), an IPC namespace of its own (no SysV or POSIX segment of the
    host or another job, none outliving it), a mount namespace of its own whose mounts do not
    reach back to the host's, with `/proc` for its PID namespace and the walls of `_walls.py`
    (its own /run, /tmp, /var/tmp and /dev/shm; no socket of the host; Landlock, where the
    kernel has it, set in `child` for the command); with `relay` (a socket to the holder's
    relay), a listener on the job's 127.0.0.1:PROXY_PORT handed to it. Raises OSError saying
    what failed."""
    walls = _sibling("_walls")
    sockets = _sibling("_sockets").host_sockets()  # the host's, from the host's namespaces
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


def _spawn_init(
    command: list[str],
    mask: set[int],
    child: Child,
    report: int,
    isolate: bool = False,
    relay: int | None = None,
) -> int:
    """Fork pid 1 of the job's own PID namespace (`_new_pid_namespace` first): it starts the
    command, writes its wait status to `report` when it ends, reaps every process that ends in
    the namespace, and leaves once none is left. When it ends, SIGKILLed included, the
    kernel kills every process left in the namespace at once, so no chain of forks can outrun
    the stop as one can outrun a walk of /proc. Signals the holder sends the tree stay
    pending in it (they are blocked, and pid 1 takes no default action from its own
    namespace's processes), so it lives until its namespace is empty or it is SIGKILLed.
    With `isolate`, it first makes the rest of the job's walls (`_isolate_init`), and leaves
    with ISOLATION_REFUSED, the command never started, if it cannot."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - pid 1 of the namespace
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if isolate:
                try:
                    _isolate_init(relay, child)
                except OSError as exc:
                    refused = f"could not start {command[0]!r}: isolation refused: {exc}\n"
                    os.write(2, refused.encode())
                    os._exit(ISOLATION_REFUSED)
            job = _spawn(command, mask, child)
            while True:
                try:
                    done, wait_status = os.waitpid(-1, 0)
                except ChildProcessError:
                    break
                if done == job:  # at once: the init may yet be killed for what the job left
                    os.write(report, wait_status.to_bytes(4, "little"))
        except BaseException:  # noqa: BLE001 - leave whatever it was; the holder sees it
            os._exit(127)
        os._exit(0)
    return pid


def _spawn_relay(channel: int, target: tuple[str, int], user: tuple[int, int] | None) -> int:
    """Fork the relay of `--proxy` (`_relay.py`) before the job's PID namespace is made, so
    the job sees it in none of its /proc: on the holder's network, as the job's `user`, it
    takes the listener the job's pid 1 hands over `channel` and carries each connection made
    to it to `target`. It dies with the holder."""
    relay = _sibling("_relay")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the relay
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            relay.serve(channel, target, user)
        except BaseException as exc:  # noqa: BLE001 - say it, then leave
            os.write(2, f"job holder: the proxy relay stopped: {exc!r}\n".encode())
        finally:
            os._exit(0)
    os.close(channel)
    return pid


def hold(
    command: list[str],
    grace: float,
    holder: int | None,
    child: Child | None = None,
    own_pids: bool = False,
    isolate: bool = False,
    proxy: tuple[str, int] | None = None,
) -> int:
    """Run `command` and everything it starts to the end; return the command's wait status.
    With `own_pids`, in a PID namespace of its own (`_spawn_init`) where the kernel allows.
    With `isolate`, in its own PID, network, IPC and mount namespaces behind the walls of
    `_walls.py`, or not at all (the status then says exit code ISOLATION_REFUSED); `proxy` is
    then its one way out (`_relay.py`)."""
    child = child or Child()
    subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, HOLDER_GONE)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    status: int | None = None
    kill_at: float | None = None  # set once a stop is asked for
    now_kill = holder is not None and os.getppid() != holder  # the launcher died already
    report: int | None = None
    relay = relay_pid = None
    if isolate and proxy is not None:
        import socket

        channel, relay_end = socket.socketpair()
        relay = relay_end.detach()
        relay_pid = _spawn_relay(channel.detach(), proxy, child.user)
    why = _new_pid_namespace(isolate) if own_pids or isolate else "not asked"
    if isolate and why:
        print(f"could not start {command[0]!r}: isolation refused: {why}", flush=True)
        if relay_pid is not None:
            os.kill(relay_pid, signal.SIGKILL)
            os.waitpid(relay_pid, 0)
        return ISOLATION_REFUSED << 8
    if not why:
        report, write_end = os.pipe()
        pid = _spawn_init(command, mask, child, write_end, isolate, relay)
        os.close(write_end)
        if relay is not None:
            os.close(relay)
    else:
        if own_pids:
            print("job holder: no PID namespace here; a stop signals the processes it finds")
        pid = _spawn(command, mask, child)
    if not subreaper:
        print("job holder: no child subreaper here; only direct children are waited for")
    while True:
        try:
            while True:
                done, wait_status = os.waitpid(-1, os.WNOHANG)
                if done == 0:
                    break
                if done == pid:
                    status = wait_status if report is None else _reported(report, wait_status)
                    if relay_pid is not None:  # the job's namespaces are gone: so is its way out
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(relay_pid, signal.SIGKILL)
        except ChildProcessError:  # nothing left under us
            break
        now = time.monotonic()
        if now_kill or (kill_at is not None and now >= kill_at):
            _signal_tree(signal.SIGKILL)
            timeout = 0.1
        elif kill_at is not None:
            timeout = max(0.01, kill_at - now)
        else:
            timeout = 1.0
        info = signal.sigtimedwait(WATCHED, timeout)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        if info.si_signo == HOLDER_GONE:
            now_kill = True
        elif kill_at is None:  # SIGTERM or SIGINT: stop the whole tree, gracefully
            kill_at = time.monotonic() + grace
            _signal_tree(signal.SIGTERM)
    return 0 if status is None else status


def _reported(report: int, init_status: int) -> int:
    """The command's wait status as its namespace's init wrote it, or the init's own (it was
    killed, and the command with it)."""
    written = os.read(report, 4)
    os.close(report)
    return int.from_bytes(written, "little") if len(written) == 4 else init_status


def _read_env() -> dict[bytes, bytes]:
    """The command's environment from stdin (NUL-separated `NAME=value`); stdin is then
    /dev/null, so the command reads nothing of the launcher's."""
    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    env = {}
    for item in b"".join(chunks).split(b"\0"):
        name, sep, value = item.partition(b"=")
        if name and sep:
            env[name] = value
    return env


USAGE = (
    "usage: _reaper.py [--grace S] [--holder PID] [--user UID:GID] [--umask OCTAL] [--cwd DIR]"
    " [--rlimit nproc|nofile|fsize|as=N]... [--env-stdin] [--own-pids] [--isolate]"
    " [--proxy HOST:PORT] [--keep PATH]... [--tmp-size N] [--probe] -- command..."
)


def main(argv: list[str]) -> None:
    grace, holder, child, env_stdin, own_pids = 10.0, None, Child(), False, False
    isolate, proxy = False, None
    if argv == ["--probe"]:  # can --isolate be had here? (a command of the holder's own)
        argv = ["--isolate", "--", sys.executable, "-I", "-S", "-c", ""]
    while argv and argv[0] != "--":
        flag, *argv = argv
        if flag in ("--env-stdin", "--own-pids", "--isolate"):
            env_stdin = env_stdin or flag == "--env-stdin"
            own_pids = own_pids or flag == "--own-pids"
            isolate = isolate or flag == "--isolate"
            continue
        if not argv:
            sys.exit(USAGE)
        value, *argv = argv
        if flag == "--grace":
            grace = float(value)
        elif flag == "--holder":
            holder = int(value)
        elif flag == "--user":
            uid, _, gid = value.partition(":")
            child.user = (int(uid), int(gid or uid))
        elif flag == "--umask":
            child.umask = int(value, 8)
        elif flag == "--cwd":
            child.cwd = value
        elif flag == "--keep":
            child.keep.append(value)
        elif flag == "--tmp-size":
            if not value.isdigit():
                sys.exit(USAGE)
            child.tmp_size = int(value)
        elif flag == "--proxy":
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit():
                sys.exit(USAGE)
            proxy = (host.strip("[]"), int(port))
        elif flag == "--rlimit":
            name, _, number = value.partition("=")
            if name not in RLIMITS or not number.isdigit():
                sys.exit(USAGE)
            child.limits.append((RLIMITS[name], int(number)))
        else:
            sys.exit(USAGE)
    command = argv[1:]
    if not command:
        sys.exit(USAGE)
    if env_stdin:
        child.env = _read_env()
    if proxy is not None and not isolate:
        sys.exit(USAGE)
    status = hold(command, grace, holder, child, own_pids, isolate, proxy)
    sys.stdout.flush()
    if os.WIFSIGNALED(status):  # die of the same signal, so the launcher sees what it saw
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # (SIGKILL cannot be caught, so needs no reset)
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
