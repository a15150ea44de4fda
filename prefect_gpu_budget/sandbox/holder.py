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

It runs as a file, `python -I -S holder.py --grace S --holder PID -- command...`, and imports
only the standard library, so it starts in milliseconds (how it starts the command, `spawn.py`,
beside it, is loaded by its path: neither this package nor its `__init__` is imported). The subreaper setting stays in this
process; the launcher's own process (and its other jobs) is untouched.

For an agent's job (`launcher.py`) the holder stays with the launcher's user (root, so that the
job cannot kill or trace it) and starts the command as another: `--user UID:GID` (no
supplementary groups), `--umask 077`, `--cwd DIR` (entered after the switch). `--env-stdin`
reads the command's environment from stdin (`NAME=value` entries, NUL-separated, until EOF):
the holder itself then runs with the launcher's minimal environment, never one the job chose
(`LD_PRELOAD` in a root process), and stdin is /dev/null for the command. `--own-pids` starts
it in a PID namespace of its own, so that its end at a stop takes every process of it at once,
however fast they fork (`spawn.spawn_init`). `--isolate` goes further, for an agent's job (`isolate`),
and refuses to start the command (exit code ISOLATION_REFUSED, one line) where the kernel will not:
the command gets, beside its own PID namespace, a network namespace of its own (only its own
loopback: no address of the host, the host's loopback included, is reachable), an IPC namespace
of its own, and a mount namespace with `/proc` mounted for its PID namespace (it sees its own
processes only, not the host's command lines and environments) behind the walls of `walls.py`:
its own /run, /tmp, /var/tmp and /dev/shm (one tmpfs of at most `--tmp-size` bytes; its `--cwd`
and each `--keep PATH` it reads are bound back in where they lie below one of them), every
host socket covered, and Landlock where the kernel has it. `--proxy HOST:PORT` (with
`--isolate`) is the one way out: a relay (`relay.py`), forked before the job's PID namespace is
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
import os
import resource
import signal
import sys
import time

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


def _spawn_module():
    """`spawn.py`, beside this file, loaded by its path (as it loads its own siblings): the
    holder runs as a file with `-I`, so neither this package nor this folder is on sys.path."""
    import importlib.util

    name = "_gpu_budget_holder_spawn"
    loaded = sys.modules.get(name)
    if loaded is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn.py")
        spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
    return loaded


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


class _Tree:
    """The command's tree while the holder holds it: the pid it waits for (the command, or
    its namespace's pid 1), where pid 1 reports the command's status, the relay's pid."""

    def __init__(self, pid: int, report: int | None, relay_pid: int | None) -> None:
        self.pid, self.report, self.relay_pid = pid, report, relay_pid
        self.status: int | None = None

    def reap(self) -> None:
        """Reap every process that ended; the command's status once it did. ChildProcessError
        once nothing is left."""
        while True:
            done, wait_status = os.waitpid(-1, os.WNOHANG)
            if done == 0:
                return
            if done == self.pid:
                self.status = (
                    wait_status if self.report is None else _reported(self.report, wait_status)
                )
                if self.relay_pid is not None:  # the job's namespaces are gone: so is its way out
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.relay_pid, signal.SIGKILL)


def _start_relay(isolate: bool, proxy: tuple[str, int] | None, spawn, child):
    """With `isolate` and `proxy`: the relay forked (`spawn.spawn_relay`), and the end of its
    channel that the job's pid 1 hands its listener over; else (None, None)."""
    if not isolate or proxy is None:
        return None, None
    import socket

    channel, relay_end = socket.socketpair()
    relay = relay_end.detach()
    return relay, spawn.spawn_relay(channel.detach(), proxy, child.user)


def _start_tree(command, mask, child, spawn, why: str, flags: tuple[bool, bool], relay):
    """Start the command: in its own PID namespace under its pid 1 where `why` is '' (the
    namespace was made), else directly. Returns the tree to wait for (relay's pid unset)."""
    own_pids, isolate = flags
    if not why:
        report, write_end = os.pipe()
        pid = spawn.spawn_init(command, mask, child, write_end, isolate, relay)
        os.close(write_end)
        if relay is not None:
            os.close(relay)
        return _Tree(pid, report, None)
    if own_pids:
        print("job holder: no PID namespace here; a stop signals the processes it finds")
    return _Tree(spawn.spawn(command, mask, child), None, None)


def _wait_out(tree: _Tree, grace: float, now_kill: bool) -> None:
    """Wait until nothing is left under the holder: a SIGTERM (or SIGINT) stops the whole
    tree, gracefully (SIGTERM, then SIGKILL after `grace`); the launcher's death
    (`HOLDER_GONE`, or `now_kill`: it died already) kills it at once."""
    kill_at: float | None = None  # set once a stop is asked for
    while True:
        try:
            tree.reap()
        except ChildProcessError:  # nothing left under us
            return
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


def hold(
    command: list[str],
    grace: float,
    holder: int | None,
    child=None,
    own_pids: bool = False,
    isolate: bool = False,
    proxy: tuple[str, int] | None = None,
) -> int:
    """Run `command` and everything it starts to the end; return the command's wait status.
    With `own_pids`, in a PID namespace of its own (`spawn.spawn_init`) where the kernel
    allows. With `isolate`, in its own PID, network, IPC and mount namespaces behind the walls
    of `walls.py`, or not at all (the status then says exit code ISOLATION_REFUSED); `proxy`
    is then its one way out (`relay.py`)."""
    spawn = _spawn_module()
    child = child or spawn.Child()
    # 1. this process: the tree's subreaper, told when the launcher dies, signals taken in turn
    subreaper = spawn.prctl(spawn.PR_SET_CHILD_SUBREAPER, 1)
    spawn.prctl(spawn.PR_SET_PDEATHSIG, HOLDER_GONE)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    now_kill = holder is not None and os.getppid() != holder  # the launcher died already
    # 2. the relay of `--proxy`, before the job's PID namespace is made
    relay, relay_pid = _start_relay(isolate, proxy, spawn, child)
    # 3. the job's own PID namespace, where asked: refused outright when isolated
    why = spawn.new_pid_namespace(isolate) if own_pids or isolate else "not asked"
    if isolate and why:
        print(f"could not start {command[0]!r}: isolation refused: {why}", flush=True)
        if relay_pid is not None:
            os.kill(relay_pid, signal.SIGKILL)
            os.waitpid(relay_pid, 0)
        return spawn.ISOLATION_REFUSED << 8
    # 4. the command, then 5. the wait until nothing is left of it
    tree = _start_tree(command, mask, child, spawn, why, (own_pids, isolate), relay)
    tree.relay_pid = relay_pid
    if not subreaper:
        print("job holder: no child subreaper here; only direct children are waited for")
    _wait_out(tree, grace, now_kill)
    return 0 if tree.status is None else tree.status


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
    "usage: holder.py [--grace S] [--holder PID] [--user UID:GID] [--umask OCTAL] [--cwd DIR]"
    " [--rlimit nproc|nofile|fsize|as=N]... [--env-stdin] [--own-pids] [--isolate]"
    " [--proxy HOST:PORT] [--keep PATH]... [--tmp-size N] [--probe] -- command..."
)
SWITCHES = ("--env-stdin", "--own-pids", "--isolate")
"""The holder's flags that take no value."""


class Options:
    """The holder's command line: how long the grace is, whose death kills the tree (the
    launcher's pid, `--holder`), how the command starts (`spawn.Child`), and the command."""

    def __init__(self, child) -> None:
        self.grace, self.holder, self.child = 10.0, None, child
        self.switches: set[str] = set()
        self.proxy: tuple[str, int] | None = None
        self.command: list[str] = []

    def take(self, flag: str, value: str) -> None:
        """One flag and its value; exits with USAGE for a bad one."""
        child = self.child
        if flag == "--grace":
            self.grace = float(value)
        elif flag == "--holder":
            self.holder = int(value)
        elif flag == "--user":
            uid, _, gid = value.partition(":")
            child.user = (int(uid), int(gid or uid))
        elif flag == "--umask":
            child.umask = int(value, 8)
        elif flag == "--cwd":
            child.cwd = value
        elif flag == "--keep":
            child.keep.append(value)
        elif flag == "--tmp-size" and value.isdigit():
            child.tmp_size = int(value)
        elif flag == "--proxy":
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit():
                sys.exit(USAGE)
            self.proxy = (host.strip("[]"), int(port))
        elif flag == "--rlimit":
            name, _, number = value.partition("=")
            if name not in RLIMITS or not number.isdigit():
                sys.exit(USAGE)
            child.limits.append((RLIMITS[name], int(number)))
        else:
            sys.exit(USAGE)


def parse(argv: list[str], child) -> Options:
    """The holder's options (`--probe`: `--isolate` with a command of its own); exits with
    USAGE for a bad command line."""
    options = Options(child)
    if argv == ["--probe"]:  # can --isolate be had here? (a command of the holder's own)
        argv = ["--isolate", "--", sys.executable, "-I", "-S", "-c", ""]
    while argv and argv[0] != "--":
        flag, *argv = argv
        if flag in SWITCHES:
            options.switches.add(flag)
            continue
        if not argv:
            sys.exit(USAGE)
        value, *argv = argv
        options.take(flag, value)
    options.command = argv[1:]
    if not options.command:
        sys.exit(USAGE)
    return options


def _exit_as(status: int) -> None:
    """Leave as the command did: of the same signal (so the launcher sees what it saw), or
    with its exit code."""
    sys.stdout.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # (SIGKILL cannot be caught, so needs no reset)
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    options = parse(argv, _spawn_module().Child())
    isolate = "--isolate" in options.switches
    if "--env-stdin" in options.switches:
        options.child.env = _read_env()
    if options.proxy is not None and not isolate:
        sys.exit(USAGE)
    own_pids = "--own-pids" in options.switches
    status = hold(
        options.command,
        options.grace,
        options.holder,
        options.child,
        own_pids,
        isolate,
        options.proxy,
    )
    _exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
