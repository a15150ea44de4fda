"""Who an agent's local job runs as: `JobUser`, and the agent sessions' own users.

`Sandbox` (`launcher.py`) picks the user; this module holds what it needs for that:

- with a uid range (`PREFECT_GPU_BUDGET_AGENT_UIDS`, `uid_range`), each agent session gets a
  user of its own (`session_user`): named `session_user_name` of the job's grant
  (`gpub-<12 hex>`), made with `useradd` from a uid of the range never given out before (a
  uid is never reused: `_free_id`), its own group, no home, no login (under a lock in
  `root/.users`, the worker's, 0700), then reused for every job of that grant. A grant is one
  session's: it is made for one session scope (`Ledger.grants.grant_agent`), and the gate refuses a job carrying it in any other scope, with
  nothing reserved (`agents.grant_refusal`), so no two sessions ever share a user (a session
  granted two tokens has two users, apart as well); jobs without a grant (an admin's) share
  one user, no agent's;
- the jobs of a session user hold a shared lock, `root/.users/<user>.lock`, while they run
  (`hold_user_lock`); the last one out takes it exclusively and removes what the user left
  in `TEMP_DIRS` (`sweep_leftovers`), once no process of the user is left;
- `unreachable`: whether a user can reach a path (by its mode bits) and use it.

Nothing here imports Prefect: the settings come from `prefect_gpu_budget.settings`.
"""

from __future__ import annotations

import fcntl
import grp
import hashlib
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from prefect_gpu_budget import settings
from prefect_gpu_budget.identity import live_processes
from prefect_gpu_budget.job import LaunchConfigError
from prefect_gpu_budget.sandbox.limits import remove_tree

SESSION_USER_PREFIX = "gpub-"
"""How the names of the agent sessions' own users (`PREFECT_GPU_BUDGET_AGENT_UIDS`) start."""
USERS_DIR = ".users"
"""The folder in `root` (the worker's, 0700) that holds the session users' locks."""
TEMP_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""The host's folders any user may write: where a session user's leftover files are removed
from once none of its jobs runs (an isolated job has private ones, gone with it; on the
host's network, `host`, it writes the host's)."""
NOLOGIN_SHELLS: tuple[str, ...] = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")
"""The session users' shell: the first of these there is."""
USERADD: tuple[str, ...] = ("/usr/sbin/useradd", "/sbin/useradd")
"""Where `useradd` is looked for (then on PATH)."""
ISSUED = "issued-uid"
"""The file in `root/.users` that holds the highest uid ever given out: never given again."""
LEFTOVER_WAIT_S = 2.0
"""How long the sweep waits for a session user's last processes (just killed) to be gone."""

logger = logging.getLogger(__name__)


def _refuse(reason: str) -> LaunchConfigError:
    return LaunchConfigError("local", reason)


@dataclass(frozen=True)
class JobUser:
    """Who a sandboxed job runs as."""

    name: str
    uid: int
    gid: int
    switch: bool
    """Whether the holder switches to this user (False: the job runs as the worker's user)."""
    session: bool = False
    """An agent session's own user (`PREFECT_GPU_BUDGET_AGENT_UIDS`): its leftovers in
    TEMP_DIRS are removed once none of its jobs runs. Until `Sandbox.prepare` makes it, uid
    and gid are -1 (every file is another user's to it)."""


def user_name(uid: int) -> str:
    """The name of the user `uid` (the number itself if it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# -- the agent sessions' own users --------------------------------------------------------


def session_user_name(grant: str | None, prefix: str = SESSION_USER_PREFIX) -> str:
    """The name of an agent session's own user: `prefix` and 12 hex digits of a hash of its
    grant id (jobs without a grant share one). The same grant, on any worker, the same name."""
    digest = hashlib.sha256(b"prefect-gpu-budget agent session\0" + (grant or "").encode())
    return prefix + digest.hexdigest()[:12]


def uid_range(uids: str | None) -> tuple[int, int]:
    """`uids` (`FIRST-LAST`) as (first, last); `LaunchConfigError` naming the setting if it is
    bad."""
    text = uids or ""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
    if not match or not 0 < first <= last < 2**31 - 1:
        raise _refuse(
            f"{settings.AGENT_UIDS_ENV} must be a range of uids FIRST-LAST above 0, like "
            f"60000-60999, got {text[:40]!r}"
        )
    return first, last


def session_user(
    grant: str | None, uids: str | None, prefix: str, root: Path, *, create: bool = False
) -> JobUser:
    """The user of an agent session (its grant; jobs with none share one user) from the range
    `uids`: looked up by its name (`session_user_name` with `prefix`), and with `create` made
    with `useradd` if missing (under a lock in `root`; `useradd`'s own lock and its refusal of
    a taken uid or name keep two workers apart). Not made yet and not `create`: uid and gid
    -1. `LaunchConfigError` if the worker is not root, the range or the prefix is bad, the
    name is taken outside the range, or no uid of the range is free."""
    first, last = uid_range(uids)
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,15}", prefix):
        raise _refuse(f"bad agent user prefix {prefix!r}: a-z, 0-9, _ and -")
    if os.geteuid() != 0:
        raise _refuse(
            f"{settings.AGENT_UIDS_ENV} needs a root worker (it makes the agents' users "
            f"and switches to them); this one runs as {user_name(os.geteuid())!r}"
        )
    name = session_user_name(grant, prefix)
    entry = _lookup_user(name)
    if entry is None and create:
        entry = _create_user(name, first, last, uids, root)
    if entry is None:
        if _useradd() is None:
            raise _refuse(f"cannot make agent users here: no useradd ({settings.AGENT_UIDS_ENV})")
        return JobUser(name, -1, -1, switch=True, session=True)
    if not first <= entry.pw_uid <= last:
        raise _refuse(
            f"user {name!r} has uid {entry.pw_uid}, outside "
            f"{settings.AGENT_UIDS_ENV}={uids}: remove it or widen the range"
        )
    return JobUser(name, entry.pw_uid, entry.pw_gid, switch=True, session=True)


def _create_user(
    name: str, first: int, last: int, uids: str | None, root: Path
) -> pwd.struct_passwd:
    useradd = _useradd()
    if useradd is None:
        raise _refuse(f"cannot make agent users here: no useradd ({settings.AGENT_UIDS_ENV})")
    shell = next((s for s in NOLOGIN_SHELLS if os.path.exists(s)), "/bin/false")
    why = ""
    with _locked(_users_dir(root) / "users.lock", exclusive=True):
        for _ in range(8):
            entry = _lookup_user(name)
            if entry is not None:
                return entry
            uid = _free_id(first, last, root)
            if uid is None:
                raise _refuse(
                    f"no uid left in {settings.AGENT_UIDS_ENV}={uids} for the agent user "
                    f"{name!r}: each uid is given once, never again; widen the range"
                )
            bounds = [f"{k}={uid}" for k in ("SYS_UID_MIN", "SYS_UID_MAX")]
            bounds += [f"{k}={uid}" for k in ("SYS_GID_MIN", "SYS_GID_MAX")]
            made = subprocess.run(
                [useradd, "--system", "--no-create-home", "--no-log-init"]
                + ["--home-dir", "/nonexistent", "--shell", shell, "--uid", str(uid)]
                + ["--user-group", *(x for b in bounds for x in ("-K", b)), name],
                capture_output=True,
                text=True,
                errors="replace",
                env={"PATH": os.defpath, "LC_ALL": "C"},
                timeout=60,
            )
            why = (made.stderr.strip().splitlines() or [f"exit code {made.returncode}"])[-1]
            if made.returncode == 0:
                entry = _lookup_user(name)
                if entry is not None:
                    _record_issued(root, entry.pw_uid)
                    logger.info("made agent user %s (uid %d)", name, entry.pw_uid)
                    return entry
            elif made.returncode not in (4, 9):  # 4, 9: uid or name taken meanwhile
                break
    raise _refuse(f"could not make the agent user {name!r}: {why[:200]}")


def _lookup_user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _useradd() -> str | None:
    found = [p for p in USERADD if os.access(p, os.X_OK)]
    return found[0] if found else shutil.which("useradd")


def _free_id(first: int, last: int, root: Path) -> int | None:
    """The lowest id of first..last above every id given out here before
    (`root/.users/ISSUED`) and above every uid and gid of the range in use (a user's, a
    group's, the owner of a live process or of a file at the top of TEMP_DIRS or of `root`):
    a uid is never given twice, so a new session never inherits what an old one of a removed
    user left anywhere on the host."""
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    taken |= _owners(first, last, root)
    floor = max([_issued(root), *(t for t in taken if first <= t <= last)], default=0)
    return next((i for i in range(max(first, floor + 1), last + 1) if i not in taken), None)


def _issued(root: Path) -> int:
    """The highest uid given out from `root` so far (0: none)."""
    try:
        text = (_users_dir(root) / ISSUED).read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def _record_issued(root: Path, uid: int) -> None:
    """Remember `uid` as given out, for good (written whole, then renamed over the old)."""
    if uid <= _issued(root):
        return
    folder = _users_dir(root)
    fresh = folder / f".{ISSUED}.{os.getpid()}"
    fresh.write_text(f"{uid}\n")
    os.replace(fresh, folder / ISSUED)


def _owners(first: int, last: int, root: Path) -> set[int]:
    """The uids of first..last that own a live process, or an entry at the top of TEMP_DIRS
    or of `root`."""
    owners: set[int] = set()

    def owned(folder: str) -> bool:
        uid = os.stat(folder).st_uid
        if first <= uid <= last:
            owners.add(uid)
        return False

    live_processes(owned)
    for folder in (*TEMP_DIRS, str(root)):
        with suppress(OSError):
            for entry in os.scandir(folder):
                with suppress(OSError):
                    uid = entry.stat(follow_symlinks=False).st_uid
                    if first <= uid <= last:
                        owners.add(uid)
    return owners


# -- the session users' locks, and their leftovers ----------------------------------------


def private_folder(folder: Path, parents: bool = False) -> Path:
    """`folder`, made if absent (with `parents`, the folders above it too, as the umask
    says), and the worker's alone (0700): LaunchConfigError when it is a link, not a folder,
    or another user's."""
    if parents:
        folder.parent.mkdir(parents=True, exist_ok=True)
    with suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise _refuse(f"{folder} is not this worker's folder")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


def _users_dir(root: Path) -> Path:
    """`root/.users`, the worker's alone (0700)."""
    return private_folder(root / USERS_DIR)


def _lock_fd(path: Path) -> int:
    """An open lock file of the worker's (0600, never through a link)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


@contextmanager
def _locked(path: Path, exclusive: bool) -> Iterator[None]:
    fd = _lock_fd(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def hold_user_lock(root: Path, user: JobUser) -> int:
    """The lock of a session user, `root/.users/<user>.lock`, held shared (while one of its
    jobs runs: its leftovers stay until the last one ends). The caller closes it, after
    `sweep_leftovers`."""
    lock = _lock_fd(_users_dir(root) / f"{user.name}.lock")
    fcntl.flock(lock, fcntl.LOCK_SH)
    return lock


def _processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose owner is `uid`."""
    return live_processes(lambda folder: os.stat(folder).st_uid == uid)


def sweep_leftovers(lock: int, user: JobUser) -> None:
    """Remove what `user` (a session's own) owns at the top of each of TEMP_DIRS, if no job of
    it runs any more: `lock` (held shared by this job) is taken exclusively, without waiting,
    and no process of the user is left. A folder goes whole (never through a link)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another job of this user runs: its files stay
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while _processes_of(user.uid):
        if time.monotonic() >= deadline:
            logger.info("agent user %s still runs processes: its temp files stay", user.name)
            return
        time.sleep(0.05)
    for folder in TEMP_DIRS:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != user.uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(Path(entry.path))  # whatever its depth
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


# -- what a user can reach ----------------------------------------------------------------


def _permits(path: str, user: JobUser, want: int) -> bool:
    """Whether the mode bits of `path` give `user` (no supplementary groups) `want`
    (`os.R_OK | os.W_OK | os.X_OK`). ACLs are not read."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid == user.uid:
        bits = st.st_mode >> 6
    elif st.st_gid == user.gid:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


def unreachable(path: str, user: JobUser, want: int) -> str:
    """Why `user` cannot reach `path` (every folder on the way, and on the way to where its
    links lead, searchable) and use it as `want`; empty if it can."""
    if user.uid == 0:
        return ""
    for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        for folder in reversed(Path(candidate).parents):
            if not _permits(str(folder), user, os.X_OK):
                return f"{folder} is not searchable by {user.name!r}"
    if not _permits(path, user, want):
        return f"{path} is not {'executable' if want == os.X_OK else 'usable'} by {user.name!r}"
    return ""
