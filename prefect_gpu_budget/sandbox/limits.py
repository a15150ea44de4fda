"""An agent job's limits: the kernel's (set by the job holder on its processes) and the
launcher's (its folder's size and its output, enforced while it runs)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import suppress
from pathlib import Path

from prefect_gpu_budget import settings
from prefect_gpu_budget.job import LaunchConfigError

GIB = 1 << 30
DEFAULT_LIMITS: dict[str, int | None] = {
    "nproc": 8192,
    "nofile": 65536,
    "fsize": 256 * GIB,
    "as": None,
    "disk": 256 * GIB,
    "output": 64 << 20,
}
"""Each agent job's resource limits, unless `PREFECT_GPU_BUDGET_AGENT_LIMIT_<NAME>` says
otherwise (None: unlimited, i.e. the worker's own limit). Set soft and hard on the job's
processes, never above the worker's hard limit. Chosen not to stop a normal GPU training job:

- `nproc` (RLIMIT_NPROC): processes and threads of the job's user, all of its jobs together
  (every agent's, with one shared agent user; not enforced for root). A DDP job of 8 ranks
  with data-loader workers runs some hundreds or a thousand threads; a fork bomb stops here.
- `nofile` (RLIMIT_NOFILE): open files per process (data loaders sharing tensors through
  file descriptors need thousands).
- `fsize` (RLIMIT_FSIZE): the largest file the job may write (SIGXFSZ past it): room for an
  unsharded checkpoint of a 13B model with its optimizer state; a quota bounds the disk.
- `as` (RLIMIT_AS): address space, unlimited: CUDA reserves far more virtual memory than it
  uses, so any bound an admin would pick for memory stops CUDA from starting.

Two more are the launcher's to enforce (`SandboxedJob.tick`, `SandboxedJob.output`), not the
kernel's:

- `disk`: what the job's folder holds (its TMPDIR included), what its private /run, /tmp,
  /var/tmp and /dev/shm hold (one tmpfs, itself no larger than the cap), and what its
  processes hold open or mapped that no folder shows any more (unlinked files), measured
  every DISK_CHECK_S; past it the job is stopped, with the reason. On the host's network
  (`host`, no private folders), for an agent session's own user, what that user owns in
  the host's temporary folders counts instead. Whatever the cap, a job is also stopped when the
  disk under its folder has less than DISK_RESERVE free while the job holds more than that:
  several jobs together cannot fill it either.
- `output`: what the job prints that reaches the run's logs; past it the rest is dropped, and
  one line says so."""
HOLDER_LIMITS: tuple[str, ...] = ("nproc", "nofile", "fsize", "as")
"""The limits the job holder sets on the job's processes (`--rlimit`)."""
DISK_CHECK_S = 5.0
"""How often a running job's folder is measured against its `disk` limit."""
DISK_RESERVE = GIB
"""The free space a job's disk keeps: a job holding more than this is stopped below it."""
_SIZE_RE = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNLIMITED = ("unlimited", "infinity", "inf", "none")


def parse_limits(limits: tuple[tuple[str, str], ...]) -> tuple[tuple[str, int], ...]:
    """The limits (name, text) that bound a job (unlimited ones left out), as numbers;
    `LaunchConfigError` naming the setting for a bad one."""
    found = []
    for name, text in limits:
        env = settings.AGENT_LIMIT_ENVS.get(name)
        if env is None:
            known = ", ".join(DEFAULT_LIMITS)
            raise LaunchConfigError("local", f"unknown agent job limit {name!r}; known: {known}")
        if text.lower() in _UNLIMITED:
            continue
        match = _SIZE_RE.fullmatch(text)
        value = int(match[1]) << (10 * " kmgt".index(match[2].lower() or " ")) if match else 0
        if not 0 < value < 2**63:
            raise LaunchConfigError(
                "local",
                f"{env} must be a positive number (a size may end in K, M, G or T) or "
                f"'unlimited', got {text[:40]!r}",
            )
        found.append((name, value))
    return tuple(found)


class OverLimit(Exception):
    """A running job passed a limit its launcher enforces (`SandboxedJob.tick`): stop it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def folder_bytes(folder: Path, owner: int | None = None) -> int:
    """The disk space the files under `folder` take (blocks, each inode once; never through
    a link); with `owner`, only what that uid owns at the top of `folder` counts (and all
    that is below it). Walked by folder descriptors, without recursion: no depth of folders,
    nor a path past PATH_MAX, hides a file from it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for st in _tree(folder, owner):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _tree(folder: Path, owner: int | None = None) -> Iterator[os.stat_result]:
    """The stat of every entry below `folder` (never through a link), walked with folder
    descriptors (`openat`) on a stack of its own; with `owner`, only the top entries of that
    uid and what is below them."""
    try:
        top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    stack = [(top, True)]
    while stack:
        fd, at_top = stack.pop()
        try:
            names = os.listdir(fd)
        except OSError:
            names = []
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if at_top and owner is not None and st.st_uid != owner:
                continue
            yield st
            if stat.S_ISDIR(st.st_mode):
                try:
                    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                    stack.append((os.open(name, flags, dir_fd=fd), False))
                except OSError:
                    continue
        os.close(fd)


def remove_tree(folder: Path) -> None:
    """Remove `folder` and everything below it (never through a link), without recursion:
    no depth of folders, nor a path past PATH_MAX, leaves anything behind."""
    try:
        parent = os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        _remove_below(parent, folder.name)
    finally:
        os.close(parent)


def _remove_below(parent: int, name: str) -> None:
    """Remove the entry `name` of the open folder `parent`, whatever it holds: folders are
    emptied on a stack of (folder descriptor, name in its parent, parent descriptor); one that
    cannot be emptied is left, and not tried again."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        stack = [(os.open(name, flags, dir_fd=parent), name, parent)]
    except OSError:
        with suppress(OSError):
            os.unlink(name, dir_fd=parent)
        return
    stuck: set[tuple[int, int]] = set()
    while stack:
        fd, own_name, above = stack[-1]
        if _push_subfolder(fd, stack, stuck):
            continue
        stack.pop()
        try:
            os.rmdir(own_name, dir_fd=above)
        except OSError:
            st = os.fstat(fd)
            stuck.add((st.st_dev, st.st_ino))
        os.close(fd)


def _push_subfolder(fd: int, stack: list, stuck: set[tuple[int, int]]) -> bool:
    """Unlink every file of the open folder `fd`; push its first subfolder not `stuck` onto
    `stack` (True), or none is left (False)."""
    try:
        names = os.listdir(fd)
    except OSError:
        return False
    for entry in names:
        try:
            os.unlink(entry, dir_fd=fd)
            continue
        except IsADirectoryError:
            pass
        except OSError:
            continue
        try:
            sub = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            continue
        st = os.fstat(sub)
        if (st.st_dev, st.st_ino) in stuck:
            os.close(sub)
            continue
        stack.append((sub, entry, fd))
        return True
    return False


def size_text(n: int) -> str:
    """Bytes as people read them: `1.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def private_bytes(pids: Iterable[int], folder: str = "/run") -> tuple[int, set[int]]:
    """What the private tmpfs (`folder` as the job sees it) of every mount namespace among
    `pids` other than this process's holds, and the devices of those tmpfs."""
    try:
        mine = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return 0, set()
    held: dict[int, int] = {}
    for pid in pids:
        root = f"/proc/{pid}/root{folder}"
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") == mine:
                continue
            device = os.stat(root).st_dev
            if device not in held:
                vfs = os.statvfs(root)
                held[device] = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        except OSError:
            continue  # ended meanwhile
    return sum(held.values()), set(held)


def unlinked_bytes(pids: Iterable[int], skip: set[int] = frozenset()) -> int:
    """The disk space of the files `pids` hold open or mapped that no folder shows any more
    (unlinked), each once, except those on the devices `skip` (counted there already)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        handles = []
        for kind in ("fd", "map_files"):
            try:
                handles += [
                    f"/proc/{pid}/{kind}/{name}" for name in os.listdir(f"/proc/{pid}/{kind}")
                ]
            except OSError:
                continue
        for handle in handles:
            try:
                st = os.stat(handle)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            unlinked = stat.S_ISREG(st.st_mode) and st.st_nlink == 0
            if unlinked and st.st_dev not in skip and key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return total
