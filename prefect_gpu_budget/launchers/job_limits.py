"""An agent job's limits: the kernel's (set by the job holder on its processes) and the
launcher's (its folder's size and its output, enforced while it runs)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from prefect_gpu_budget import settings
from prefect_gpu_budget.launchers.base import LaunchConfigError

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
    that is below it)."""
    seen: set[int] = set()
    total = 0
    for top, dirs, files in os.walk(folder):
        for name in list(dirs) + files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if owner is not None and top == str(folder) and st.st_uid != owner:
                if name in dirs:
                    dirs.remove(name)
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


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
