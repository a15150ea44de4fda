"""The walls of an isolated job's files, made by its pid 1 (`holder.py --isolate`) in the
job's own mount namespace before the command starts. Standard library only: the holder runs
as a file, and imports this one beside it.

1. **Its own temporary folders** (`private_dirs`): one tmpfs, of at most the job's disk cap
   (and half the host's memory, as any tmpfs: it is memory), over `/run` (so `/run/lock` and
   `/var/run` too), with folders of it bound over `/tmp`, `/var/tmp` and `/dev/shm`, and a fresh POSIX message-queue filesystem where the host has
   one. Everything the job leaves there is gone with its namespace; nothing the host or
   another job keeps there is seen. The job's own folder, its interpreter and its code, where
   they live below one of these, are bound back in (the folder writable, the rest read-only).
2. **No socket of the host** (`mask_sockets`): every path a unix socket of the host can be
   reached at (`sockets.host_sockets`: every network namespace's, followed into other mount
   namespaces and through bind mounts, read before the job's own namespaces are made) that the
   job could still reach is covered by an empty read-only file, so `connect()` there is
   refused. With the tmpfs over `/run` and `/tmp` that covers PostgreSQL's, Redis's, MariaDB's
   and Docker's, and any other socket on the host when the job starts. Abstract sockets belong
   to a network namespace, and the job has its own.
3. **No kernel keys** (`forbid_keys`, in the job's process): a seccomp filter refuses
   `add_key`, `request_key` and `keyctl` (as Docker's default profile does): a user's keyrings
   outlive its processes and are shared by all of them, so one job could leave data for the
   next of its user.
4. **Landlock** (`landlock_ruleset`, then `landlock_restrict` in the job's process), where the
   kernel has it, a second wall: the job may create, change, rename or remove files only
   below its own folder and its private folders (and write to devices, for the GPUs), and,
   from Landlock ABI 6, may signal nothing and reach no abstract socket outside its own
   domain. Where the kernel controls the resolution of pathname unix sockets
   (LANDLOCK_ACCESS_FS_RESOLVE_UNIX), it may connect to none outside those folders either,
   sockets made after the job started included.
"""

from __future__ import annotations

import ctypes
import os
import stat

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MS_RELATIME, ST_RELATIME = 1 << 21, 4096
KEPT_FLAGS = 2 | 4 | 8 | 1024 | 2048
"""nosuid, nodev, noexec, noatime, nodiratime: the same bits in statvfs's f_flag and mount(2)."""
PRIVATE_ROOT = "/run"
"""Where the job's one tmpfs is mounted; its other private folders are folders of it."""
PRIVATE_BINDS: tuple[tuple[str, str], ...] = (
    ("/tmp", ".job/tmp"),
    ("/var/tmp", ".job/var-tmp"),
    ("/dev/shm", ".job/shm"),
)
"""Each host folder the job gets a private one of, and where in the tmpfs that one lives."""
MASKED: tuple[str, ...] = ("/run", "/var/run", "/tmp", "/var/tmp", "/dev/shm")
"""The host folders the job sees none of (/var/run is /run on most systems)."""
COVER = ".job/socket"
"""The empty read-only file (in the tmpfs) bound over each socket of the host."""

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_WRITE_FILE = 1 << 1
FS_WRITES_V1 = FS_WRITE_FILE | sum(1 << b for b in range(4, 13))
"""WRITE_FILE, REMOVE_DIR, REMOVE_FILE and MAKE_* (char, dir, reg, sock, fifo, block, sym)."""
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
FS_RESOLVE_UNIX = 1 << 16
"""Connecting to a pathname unix socket (newer kernels; probed, not assumed)."""
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    """mount(2); OSError naming the target when it fails."""
    enc = [None if x is None else os.fsencode(x) for x in (source, target, fstype)]
    if _libc().mount(*enc, flags, os.fsencode(data) if data else None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {target}: {os.strerror(error)}")


def under_masked(path: str) -> bool:
    """Whether `path` lies in one of the MASKED folders (as it is written, or where it leads)."""
    for candidate in {os.path.abspath(path), os.path.realpath(path)}:
        if any(candidate == m or candidate.startswith(m + "/") for m in MASKED):
            return True
    return False


def private_dirs(size: int | None, keep_ro: list[str], keep_rw: list[str]) -> None:
    """Mount the job's private folders (see the module's doc), at most `size` bytes together
    and never more than half the host's memory, then bind each of `keep_rw`
    (writable) and `keep_ro` (read-only) that lies in one of them back at its own path."""
    kept = []
    for path, writable in [(p, True) for p in keep_rw] + [(p, False) for p in keep_ro]:
        for where in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
            if under_masked(where) and os.path.exists(where):
                kept.append((where, os.open(where, os.O_PATH | os.O_CLOEXEC), writable))
    var_run_apart = os.path.isdir("/var/run") and not os.path.islink("/var/run")
    opts = f"mode=0755,size={memory_bound(size)}"
    mount("tmpfs", PRIVATE_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    _folder(f"{PRIVATE_ROOT}/lock", 0o1777)
    _folder(f"{PRIVATE_ROOT}/.job", 0o711)
    for host, own in PRIVATE_BINDS:
        if os.path.isdir(host):
            _folder(f"{PRIVATE_ROOT}/{own}", 0o1777)
            mount(f"{PRIVATE_ROOT}/{own}", host, None, MS_BIND)
    if var_run_apart:
        mount(PRIVATE_ROOT, "/var/run", None, MS_BIND)
    if os.path.isdir("/dev/mqueue"):
        mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV)
    for where, fd, writable in sorted(kept):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(where, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(where), mode=0o755, exist_ok=True)
            os.close(os.open(where, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o444))
        mount(f"/proc/self/fd/{fd}", where, None, MS_BIND | MS_REC)
        if not writable:
            read_only(where)
        os.close(fd)


def read_only(target: str) -> None:
    """Remount the bind mount at `target` read-only and nosuid, keeping the flags it has (a
    user namespace may only add to those of a mount it did not make)."""
    kept = os.statvfs(target).f_flag & KEPT_FLAGS
    relatime = MS_RELATIME if os.statvfs(target).f_flag & ST_RELATIME else 0
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept | relatime)


def bound_ipc(size: int | None) -> None:
    """Bound the SysV shared memory and message queues of the job's own IPC namespace (a new
    one allows all but unlimited shared memory): its segments together to what its private
    folders may hold, and its message queues to 64 of the kernel's default size."""
    most, page = memory_bound(size), os.sysconf("SC_PAGE_SIZE")
    for name, value in (("shmmax", most), ("shmall", most // page), ("msgmni", 64)):
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as handle:
                handle.write(str(value))
        except OSError:
            continue  # a kernel without it: its default stands


def memory_bound(size: int | None) -> int:
    """`size`, and never more than half the host's memory (tmpfs's own default)."""
    half = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    return min(size or half, half)


def _folder(path: str, mode: int) -> None:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)


def mask_sockets(sockets: list[str]) -> int:
    """Cover each of `sockets` (`sockets.host_sockets`, read before the job's own folders were
    mounted) that is still a socket in this mount namespace with an empty read-only file
    (`COVER`); returns how many were covered."""
    cover = f"{PRIVATE_ROOT}/{COVER}"
    if not os.path.exists(cover):
        os.close(os.open(cover, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o444))
    covered = 0
    for path in sockets:
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                continue
            target = os.path.realpath(path)
            mount(cover, target, None, MS_BIND)
            read_only(target)
        except OSError:
            continue  # gone meanwhile, or not ours to cover: Landlock, where there, still holds
        covered += 1
    return covered


# -- Landlock -------------------------------------------------------------------------------


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (or it is disabled)."""
    libc = _libc()
    version = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return max(0, version)


def _create_ruleset(handled: int, scoped: int, abi: int) -> int:
    attr = (ctypes.c_uint64 * 3)(handled, 0, scoped)
    size = 24 if abi >= 6 else 8
    return _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_ruleset(writable: list[str], devices: list[str]) -> tuple[int | None, str]:
    """A Landlock ruleset for the job, made here (before the switch of user, so every path
    can be opened): it may change files below `writable` only, and write to files below
    `devices`. Returns (its fd, what it confines, in a few words), or (None, why not) where
    the kernel has no Landlock."""
    abi = landlock_abi()
    if abi < 1:
        return None, "no Landlock in this kernel"
    handled = FS_WRITES_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    fd = _create_ruleset(handled | FS_RESOLVE_UNIX, scoped, abi)
    sockets = fd >= 0
    if not sockets:
        fd = _create_ruleset(handled, scoped, abi)
    if fd < 0:
        return None, f"Landlock refused a ruleset ({os.strerror(ctypes.get_errno())})"
    handled |= FS_RESOLVE_UNIX if sockets else 0
    rules = [(p, handled) for p in writable] + [(p, FS_WRITE_FILE | FS_TRUNCATE) for p in devices]
    for path, allowed in rules:
        try:
            parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not os.path.isdir(f"/proc/self/fd/{parent}"):
                allowed &= FS_WRITE_FILE | FS_TRUNCATE  # only file rights apply to a file
            rule = _PathBeneath(allowed & handled, parent)
            if (
                _libc().syscall(
                    SYS_LANDLOCK_ADD_RULE, fd, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
                )
                != 0
            ):
                error = ctypes.get_errno()
                os.close(fd)
                raise OSError(error, f"Landlock rule for {path}: {os.strerror(error)}")
        finally:
            os.close(parent)
    what = f"Landlock ABI {abi}: files" + (", unix sockets" if sockets else "")
    return fd, what + (", signals" if scoped else "")


def landlock_restrict(ruleset: int) -> None:  # pragma: no cover - in the job's process
    """Confine this process (and all it starts) by `ruleset`; needs no_new_privs set."""
    if _libc().syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"Landlock: {os.strerror(error)}")
    os.close(ruleset)


# -- no kernel keys -------------------------------------------------------------------------

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
X32_BIT = 0x40000000
KEY_CALLS: dict[int, tuple[int, ...]] = {
    0xC000003E: (248, 249, 250),  # x86_64: add_key, request_key, keyctl
    0x40000003: (286, 287, 288),  # i386, from a 64-bit kernel
    0xC00000B7: (217, 218, 219),  # aarch64
    0x40000028: (309, 310, 311),  # arm (32-bit)
}
"""The key management calls of each architecture (seccomp's AUDIT_ARCH_* values)."""


class _Filter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def key_filter() -> list[tuple[int, int, int, int]]:
    """The classic BPF program that refuses (EPERM) the key calls of KEY_CALLS on each
    architecture (and every x32 call on x86_64), and allows everything else."""
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    program: list[tuple[int, int, int, int]] = []
    for arch, calls in KEY_CALLS.items():
        checks = len(calls) + (1 if arch == 0xC000003E else 0)
        block = [(load, 0, 0, 4), (jeq, 0, checks + 2, arch), (load, 0, 0, 0)]
        for i, call in enumerate(calls):
            block.append((jeq, -(i + 1), 0, call))  # to the refusal: patched below
        if arch == 0xC000003E:
            block.append((jge, -(len(calls) + 1), 0, X32_BIT))
        block.append((ret, 0, 0, SECCOMP_RET_ALLOW))
        program += block
    program += [(ret, 0, 0, SECCOMP_RET_ALLOW), (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    refusal = len(program) - 1
    return [
        (code, refusal - i - 1 if jt < 0 else jt, jf, k)
        for i, (code, jt, jf, k) in enumerate(program)
    ]


def forbid_keys() -> None:  # pragma: no cover - in the job's process
    """Install `key_filter` on this process and all it starts (needs no_new_privs set)."""
    rules = key_filter()
    array = (_Filter * len(rules))(*(_Filter(*rule) for rule in rules))
    program = _Program(len(rules), array)
    if _libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"seccomp: {os.strerror(error)}")
