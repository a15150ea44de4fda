"""The sandbox agents' local jobs run in: another user, a stripped environment, a fresh folder.

An agent's command must not see the worker's secrets (the ledger URL and its password, cloud
keys, Prefect's auth string) nor act as the worker. `LocalLauncher(sandbox=Sandbox.from_env())`
runs it

- as an unprivileged user, started by the job holder, which stays the worker's user (root), so
  the job cannot kill or trace it: with a uid range (`PREFECT_GPU_BUDGET_AGENT_UIDS`), a user
  of the agent session's own (`session_user_name` of the job's grant, `gpub-<12 hex>`, made
  with `useradd` from a free uid of the range, its own group, no home, no login, then reused
  for every job of that grant), so agents cannot signal, trace or read each other's jobs,
  folders or files; else the one user `PREFECT_GPU_BUDGET_AGENT_USER`, which every agent
  shares;
- within resource limits (`DEFAULT_LIMITS`, `PREFECT_GPU_BUDGET_AGENT_LIMIT_*`): processes,
  open files, file size, address space, set by the holder on the job's processes only;
- with only allow-listed names of the worker's environment (`DEFAULT_ENV_ALLOW`, plus
  `PREFECT_GPU_BUDGET_AGENT_ENV`), `HOME` set to its own folder, the `PYTHONPATH` this
  package needs, and the job's and launcher's own variables;
- in a fresh folder of its own, `root/<job name>-<random>` (0700, the job user's), removed
  when the job ends: `root` is 0711, so no user can list the other jobs' folders. `TMPDIR` is
  `tmp/` in it, so the job's temp files go with it. A session user's files left in
  `TEMP_DIRS` (/tmp, /var/tmp, /dev/shm) are removed once no job of that user runs any more
  (the jobs of a user hold a shared lock, `root/.users/<user>.lock`, while they run; the last
  one out takes it exclusively and sweeps). The shared agent user's are not: other agents'
  running jobs, or other programs of that user (`nobody`), may own them;
- with a Python it can run: `python` and `python3` come first on its PATH and start the
  interpreter `Sandbox.interpreter` picks (`PREFECT_GPU_BUDGET_AGENT_PYTHON`, else this
  worker's own if the user can reach it, else the system's `python3`), and a command that
  starts with this worker's own interpreter (a sweep's `callable:` trial) starts with that one
  instead. Its PYTHONPATH reaches the trial runner (`python -m prefect_gpu_budget.flows.trial`,
  standard library only): this package's source checkout where the user can read it, else
  (installed, or out of reach) a copy of the few files the runner imports (`TRIAL_SOURCES`). Both live in the job's folder, in
  `.gpu-budget/` (the worker's, 0755);
- with its output redacted (`Redactor`): any value of the worker's environment the job was
  not given, and the password of any URL there, shows as `***`.

The metrics file the launcher names (`GPU_BUDGET_METRICS_FILE`) is, for the job, a file in its
own folder; when the job has ended, what it wrote is appended to the launcher's file. So the
job needs no access to the worker's results folder, and no file outside `root` is ever left
to the job's user.

Nothing here imports Prefect: the settings come from `prefect_gpu_budget.settings`.
"""

from __future__ import annotations

import fcntl
import fnmatch
import grp
import hashlib
import logging
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from prefect_gpu_budget import settings
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.units import redact_urls, url_credentials

DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
    "OMP_NUM_THREADS",
)
"""The names of the worker's environment every agent job gets (when the worker has them)."""
NEVER_BY_PATTERN: tuple[str, ...] = (
    "PREFECT_*",
    "AWS_*",
    "GOOGLE_*",
    "GCLOUD_*",
    "CLOUDSDK_*",
    "AZURE_*",
    "*SECRET*",
    "*TOKEN*",
    "*PASS*",
    "*_PW",
    "*_PWD",
    "*CREDENTIAL*",
    "*CREDS*",
    "*KEY*",
    "*_PAT",
    "*_PAT_*",
    "*AUTH*",
    "*PRIVATE*",
    "*COOKIE*",
    "*SIGNING*",
    "*NETRC*",
    "*DATABASE_URL*",
    "*DB_URL*",
    "*DB_URI*",
    "*DSN*",
    "*CONN*STR*",
)
"""Names an allow-list pattern (`LC_*`, even `*`) never lets through, whatever their case: only
an exact name does. Nor does a pattern let through a value holding a URL's credentials."""
MIN_SECRET_LEN = 8
"""Shorter withheld values (`1`, `true`, `/root`) are not redacted: they would blank out text."""
MIN_PASSWORD_LEN = 4
"""The shortest URL password that is redacted on its own."""
MAX_METRICS_BYTES = 64 << 20
"""At most this much of a job's metrics file is copied to the launcher's."""
SYSTEM_PYTHONS: tuple[str, ...] = ("/usr/bin/python3", "/usr/local/bin/python3")
"""Where an interpreter for the job is looked for when this worker's own is out of its reach."""
PYTHON_NAMES: tuple[str, ...] = ("python", "python3")
"""The names the job's PATH gives the interpreter (`bin/` of its `.gpu-budget` folder)."""
TRIAL_SOURCES: tuple[str, ...] = (
    "prefect_gpu_budget/__init__.py",
    "prefect_gpu_budget/_lazy.py",
    "prefect_gpu_budget/settings.py",
    "prefect_gpu_budget/flows/__init__.py",
    "prefect_gpu_budget/flows/trial.py",
)
"""Every file of this package that `python -m prefect_gpu_budget.flows.trial` imports."""
TOOLS_DIR = ".gpu-budget"
"""The folder, in the job's own, that holds `bin/` (PYTHON_NAMES) and `lib/` (TRIAL_SOURCES)."""
ROOT_REFUSED = (
    "agent jobs do not run as root: set PREFECT_GPU_BUDGET_AGENT_USER to an unprivileged user "
    "(or PREFECT_GPU_BUDGET_AGENT_ALLOW_ROOT=1)"
)
SESSION_USER_PREFIX = "gpub-"
"""How the names of the agent sessions' own users (`PREFECT_GPU_BUDGET_AGENT_UIDS`) start."""
USERS_DIR = ".users"
"""The folder in `root` (the worker's, 0700) that holds the session users' locks."""
TEMP_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")
"""Where a session user's leftover files are removed from once none of its jobs runs."""
NOLOGIN_SHELLS: tuple[str, ...] = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")
"""The session users' shell: the first of these there is."""
USERADD: tuple[str, ...] = ("/usr/sbin/useradd", "/sbin/useradd")
"""Where `useradd` is looked for (then on PATH)."""
GIB = 1 << 30
DEFAULT_LIMITS: dict[str, int | None] = {
    "nproc": 8192,
    "nofile": 65536,
    "fsize": 256 * GIB,
    "as": None,
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
  uses, so any bound an admin would pick for memory stops CUDA from starting."""
_SIZE_RE = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNLIMITED = ("unlimited", "infinity", "inf", "none")

logger = logging.getLogger(__name__)
_warned_own_user = False
_warn_lock = threading.Lock()


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
    TEMP_DIRS are removed once none of its jobs runs. Until `prepare` makes it, uid and gid
    are -1 (every file is another user's to it)."""


@dataclass(frozen=True)
class Sandbox:
    """How agents' local jobs are confined (see the module's doc). Frozen and made of plain
    values: hashable, picklable, and a Prefect parameter like any other."""

    user: str | None = None
    """Run the job as this unprivileged user; None: as the worker's own (refused for root)."""
    allow_root: bool = False
    """Let agent jobs run as root (the worker's root without `user`, or a `user` of uid 0)."""
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW
    """Names copied from the worker's environment; `fnmatch` patterns like `LC_*` too."""
    root: Path = field(default_factory=settings.agent_jobs_root)
    """Under which each job gets a fresh working directory of its own."""
    python: str | None = None
    """The interpreter the job's `python` starts (a path, or a name on the worker's PATH);
    None: this worker's own if the job's user can run it, else the first of SYSTEM_PYTHONS."""
    uids: str | None = None
    """A range of uids, `FIRST-LAST`: each agent session (the job's `grant`) gets a user of its
    own from it, made as needed (a root worker only); `user` is then not used."""
    user_prefix: str = SESSION_USER_PREFIX
    """How the session users' names start."""
    limits: tuple[tuple[str, str], ...] = ()
    """The job's resource limits, by name (`DEFAULT_LIMITS`' names): a number, a size (`16G`)
    or `unlimited`; a mapping may be given. Those not given keep their defaults."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "user", (self.user or "").strip() or None)
        object.__setattr__(self, "python", (self.python or "").strip() or None)
        object.__setattr__(self, "env_allow", tuple(self.env_allow))
        object.__setattr__(self, "root", Path(os.path.abspath(self.root)))
        object.__setattr__(self, "uids", (str(self.uids or "")).strip() or None)
        given = dict(self.limits.items() if isinstance(self.limits, Mapping) else self.limits)
        merged = {**DEFAULT_LIMITS, **given}
        text = {k: "unlimited" if v is None else str(v).strip() for k, v in merged.items()}
        object.__setattr__(self, "limits", tuple(sorted(text.items())))

    @classmethod
    def from_env(cls) -> Sandbox:
        """The admin's settings: PREFECT_GPU_BUDGET_AGENT_USER, _AGENT_ALLOW_ROOT, _AGENT_ENV
        (added to `DEFAULT_ENV_ALLOW`), _AGENT_ROOT, _AGENT_PYTHON, _AGENT_UIDS and
        _AGENT_LIMIT_* (checked when a job is: a bad one refuses it in one line)."""
        extra = tuple(n for n in settings.agent_env_extra() if n not in DEFAULT_ENV_ALLOW)
        return cls(
            user=settings.agent_user(),
            allow_root=settings.agent_allow_root(),
            env_allow=DEFAULT_ENV_ALLOW + extra,
            root=settings.agent_jobs_root(),
            python=settings.agent_python(),
            uids=settings.agent_uids(),
            limits=tuple(settings.agent_limits().items()),
        )

    # -- may it run? ----------------------------------------------------------------------

    def job_user(self, job: GpuJob | None = None) -> JobUser:
        """Who the job runs as; `LaunchConfigError` with a one-line reason if nobody may. With
        `uids`, the user of the job's grant (`session_user`), made only by `prepare`."""
        if self.uids is not None:
            return self.session_user(job.grant if job is not None else None)
        euid = os.geteuid()
        if self.user is None:
            if euid == 0 and not self.allow_root:
                raise _refuse(ROOT_REFUSED)
            me = JobUser(_user_name(euid), euid, os.getegid(), switch=False)
            if euid != 0:
                _warn_own_user(me.name)
            return me
        try:
            entry = pwd.getpwnam(self.user)
        except KeyError:
            raise _refuse(
                f"agent user {self.user!r} does not exist here (PREFECT_GPU_BUDGET_AGENT_USER)"
            ) from None
        if entry.pw_uid == 0 and not self.allow_root:
            raise _refuse(
                f"agent user {self.user!r} is root (uid 0): name an unprivileged user in "
                "PREFECT_GPU_BUDGET_AGENT_USER (or PREFECT_GPU_BUDGET_AGENT_ALLOW_ROOT=1)"
            )
        if entry.pw_uid == euid:
            if euid != 0:
                _warn_own_user(entry.pw_name)
            return JobUser(entry.pw_name, euid, os.getegid(), switch=False)
        if euid != 0:
            raise _refuse(
                f"cannot run agent jobs as {self.user!r}: this worker runs as "
                f"{_user_name(euid)!r}, not root, so it cannot switch user"
            )
        return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=True)

    def session_user(self, grant: str | None, *, create: bool = False) -> JobUser:
        """The user of an agent session (its grant; jobs with none share one user) from the
        range `uids`: looked up by its name (`session_user_name`), and with `create` made with
        `useradd` if missing (under a lock in `root`; `useradd`'s own lock and its refusal of
        a taken uid or name keep two workers apart). Not made yet and not `create`: uid and
        gid -1. `LaunchConfigError` if the worker is not root, the range or the prefix is
        bad, the name is taken outside the range, or no uid of the range is free."""
        first, last = self.uid_range()
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,15}", self.user_prefix):
            raise _refuse(f"bad agent user prefix {self.user_prefix!r}: a-z, 0-9, _ and -")
        if os.geteuid() != 0:
            raise _refuse(
                f"{settings.AGENT_UIDS_ENV} needs a root worker (it makes the agents' users "
                f"and switches to them); this one runs as {_user_name(os.geteuid())!r}"
            )
        name = session_user_name(grant, self.user_prefix)
        entry = _lookup_user(name)
        if entry is None and create:
            entry = self._create_user(name, first, last)
        if entry is None:
            if _useradd() is None:
                raise _refuse(
                    f"cannot make agent users here: no useradd ({settings.AGENT_UIDS_ENV})"
                )
            return JobUser(name, -1, -1, switch=True, session=True)
        if not first <= entry.pw_uid <= last:
            raise _refuse(
                f"user {name!r} has uid {entry.pw_uid}, outside "
                f"{settings.AGENT_UIDS_ENV}={self.uids}: remove it or widen the range"
            )
        return JobUser(name, entry.pw_uid, entry.pw_gid, switch=True, session=True)

    def uid_range(self) -> tuple[int, int]:
        """`uids` as (first, last); `LaunchConfigError` naming the setting if it is bad."""
        text = self.uids or ""
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
        first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
        if not match or not 0 < first <= last < 2**31 - 1:
            raise _refuse(
                f"{settings.AGENT_UIDS_ENV} must be a range of uids FIRST-LAST above 0, like "
                f"60000-60999, got {text[:40]!r}"
            )
        return first, last

    def job_limits(self) -> tuple[tuple[str, int], ...]:
        """The job's resource limits that bound it (unlimited ones left out), by name;
        `LaunchConfigError` naming the setting for a bad one."""
        found = []
        for name, text in self.limits:
            env = settings.AGENT_LIMIT_ENVS.get(name)
            if env is None:
                known = ", ".join(DEFAULT_LIMITS)
                raise _refuse(f"unknown agent job limit {name!r}; known: {known}")
            if text.lower() in _UNLIMITED:
                continue
            match = _SIZE_RE.fullmatch(text)
            value = int(match[1]) << (10 * " kmgt".index(match[2].lower() or " ")) if match else 0
            if not 0 < value < 2**63:
                raise _refuse(
                    f"{env} must be a positive number (a size may end in K, M, G or T) or "
                    f"'unlimited', got {text[:40]!r}"
                )
            found.append((name, value))
        return tuple(found)

    def _create_user(self, name: str, first: int, last: int) -> pwd.struct_passwd:
        useradd = _useradd()
        if useradd is None:
            raise _refuse(f"cannot make agent users here: no useradd ({settings.AGENT_UIDS_ENV})")
        shell = next((s for s in NOLOGIN_SHELLS if os.path.exists(s)), "/bin/false")
        why = ""
        with _locked(self._users_dir() / "users.lock", exclusive=True):
            for _ in range(8):
                entry = _lookup_user(name)
                if entry is not None:
                    return entry
                uid = _free_id(first, last)
                if uid is None:
                    raise _refuse(
                        f"no free uid left in {settings.AGENT_UIDS_ENV}={self.uids} for the "
                        f"agent user {name!r}"
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
                        logger.info("made agent user %s (uid %d)", name, entry.pw_uid)
                        return entry
                elif made.returncode not in (4, 9):  # 4, 9: uid or name taken meanwhile
                    break
        raise _refuse(f"could not make the agent user {name!r}: {why[:200]}")

    def _users_dir(self) -> Path:
        """`root/.users`, the worker's alone (0700)."""
        folder = self.root / USERS_DIR
        with suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise _refuse(f"{folder} is not this worker's folder")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(folder, 0o700)
        return folder

    def interpreter(self, user: JobUser) -> str | None:
        """The Python the job's `python` starts: `self.python` (`LaunchConfigError` if `user`
        cannot run it), else this worker's own, else the first of SYSTEM_PYTHONS, that `user`
        can reach and execute; None if none."""
        if self.python is not None:
            found = shutil.which(self.python) or ""
            why = _unreachable(found, user, os.X_OK) if found else "no such program here"
            if why:
                raise _refuse(
                    f"cannot run {settings.AGENT_PYTHON_ENV}={self.python} as {user.name!r}: {why}"
                )
            return os.path.abspath(found)
        for candidate in (sys.executable, *SYSTEM_PYTHONS):
            found = shutil.which(candidate) if candidate else None
            if found and not _unreachable(found, user, os.X_OK):
                return found
        return None

    def check(self, job: GpuJob | None = None) -> JobUser:
        """Raise `LaunchConfigError` (one line) if the job cannot run in this sandbox: no user
        to run it as, a jobs folder (`root`) that is unsafe or out of the user's reach, or a
        program the user cannot reach and execute (for `python`: no `interpreter`). Creates
        `root` (0711) if missing."""
        return self._checked(job)[0]

    def _checked(self, job: GpuJob | None, create: bool = False) -> tuple[JobUser, str | None]:
        """`check`, and the job's interpreter; with `create`, the job's session user made."""
        user = self.job_user(job)
        self.job_limits()
        self._ensure_root(user)
        if create and user.session and user.uid < 0:
            user = self.session_user(job.grant if job is not None else None, create=True)
        python = self.interpreter(user)
        if job is not None and job.command and _is_python(job.command[0]):
            if python is None:
                raise _refuse(
                    f"no Python that {user.name!r} can run for {job.command[0]!r} (this "
                    f"worker's {sys.executable} is out of its reach, and so is every one of "
                    f"{', '.join(SYSTEM_PYTHONS)}): set {settings.AGENT_PYTHON_ENV}"
                )
        elif job is not None and job.command:
            path = job.env.get("PATH", self.allowed_env().get("PATH", os.defpath))
            found = shutil.which(job.command[0], path=path)
            if found is None:
                raise _refuse(f"could not start: no program {job.command[0]!r} on the job's PATH")
            why = _unreachable(found, user, os.X_OK)
            if why:
                raise _refuse(f"could not start {job.command[0]!r} as {user.name!r}: {why}")
        return user, python

    def _ensure_root(self, user: JobUser) -> None:
        root = self.root
        try:
            root.mkdir(mode=0o711, parents=True)
            os.chmod(root, 0o711)  # whatever the umask
        except FileExistsError:
            pass
        except OSError as exc:
            raise _refuse(f"cannot make the agent jobs folder {root}: {exc}") from None
        try:
            st = os.lstat(root)
        except OSError as exc:
            raise _refuse(f"cannot use the agent jobs folder {root}: {exc}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(f"the agent jobs folder {root} is not a folder (a link, or a file)")
        if st.st_uid != os.geteuid():
            raise _refuse(
                f"the agent jobs folder {root} belongs to uid {st.st_uid}, not to this worker"
            )
        if st.st_mode & 0o022:
            raise _refuse(f"the agent jobs folder {root} is writable by other users")
        if st.st_mode & 0o044:  # listable: a job could find the other jobs' folders
            os.chmod(root, stat.S_IMODE(st.st_mode) & ~0o044)
        why = _unreachable(str(root), user, os.X_OK)
        if why:
            raise _refuse(f"the agent jobs folder {root} is out of {user.name!r}'s reach: {why}")

    # -- what the job gets ----------------------------------------------------------------

    def allowed_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The names of `environ` (the worker's) that the allow-list lets through."""
        environ = os.environ if environ is None else environ
        exact = {n for n in self.env_allow if not _is_pattern(n)}
        patterns = [n for n in self.env_allow if _is_pattern(n)]
        return {
            name: value
            for name, value in environ.items()
            if name in exact
            or (any(fnmatch.fnmatchcase(name, p) for p in patterns) and _patterns_may(name, value))
        }

    def job_env(
        self,
        workdir: Path,
        job: GpuJob,
        extra: Mapping[str, str],
        environ: Mapping[str, str],
        *,
        source: str | None = None,
        bin_dir: str | None = None,
    ) -> dict[str, str]:
        """The job's whole environment: the allowed names, `HOME` (its folder), `TMPDIR`
        (`tmp/` in it), `PYTHONPATH` (`source`, default this package's, then the worker's if
        allowed), `job.env`, then `extra` (the launcher's variables); `bin_dir` first on its
        PATH."""
        allowed = self.allowed_env(environ)
        source = _package_source() if source is None else source
        python_path = os.pathsep.join(p for p in (source, allowed.get("PYTHONPATH", "")) if p)
        own = {"HOME": str(workdir), "TMPDIR": str(workdir / "tmp"), "PYTHONPATH": python_path}
        env = {**allowed, **own, **job.env, **extra}
        if bin_dir:
            env["PATH"] = os.pathsep.join((bin_dir, env.get("PATH") or os.defpath))
        return env

    def prepare(self, job: GpuJob, extra: Mapping[str, str]) -> SandboxedJob:
        """Check (`check`), then make the job's folder and environment. `extra`: the
        launcher's variables (the holder's mark, `GPU_BUDGET_METRICS_FILE`, GPUs). The
        caller calls `finish` once every process of the job has ended."""
        user, python = self._checked(job, create=True)
        limits = self.job_limits()
        environ = dict(os.environ)
        lock = None
        if user.session:  # held while the job runs: its user's leftovers stay until the last ends
            lock = _lock_fd(self._users_dir() / f"{user.name}.lock")
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            workdir = Path(tempfile.mkdtemp(prefix=f"{_slug(job.name)}-", dir=self.root))
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise
        try:
            if user.switch:
                os.chown(workdir, user.uid, user.gid)
            tmp = workdir / "tmp"
            tmp.mkdir(mode=0o700)
            if user.switch:
                os.chown(tmp, user.uid, user.gid)
            extra = dict(extra)
            metrics = None
            if extra.get(settings.METRICS_ENV):
                mine = workdir / "metrics.jsonl"
                fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    if user.switch:
                        os.fchown(fd, user.uid, user.gid)
                finally:
                    os.close(fd)
                metrics = (mine, Path(extra[settings.METRICS_ENV]))
                extra[settings.METRICS_ENV] = str(mine)
            bin_dir, source = _offer_python(workdir / TOOLS_DIR, user, python)
            env = self.job_env(workdir, job, extra, environ, source=source, bin_dir=bin_dir)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            if lock is not None:
                os.close(lock)
            raise
        command = list(job.command or ())
        if python and command and command[0] == sys.executable:  # a `callable:` trial
            command[0] = python
        redact = Redactor.withheld(env, environ)
        return SandboxedJob(user, workdir, env, redact, metrics, command, limits=limits, lock=lock)


@dataclass
class SandboxedJob:
    """One job's sandbox, made by `Sandbox.prepare`."""

    user: JobUser
    workdir: Path
    env: dict[str, str]
    redact: Redactor
    metrics: tuple[Path, Path] | None = None
    """(the job's metrics file, the launcher's): copied over by `finish`."""
    command: list[str] = field(default_factory=list)
    """What to run: the job's command, with this worker's interpreter, when it starts with
    it, replaced by the job's (`Sandbox.interpreter`)."""
    copied: int = 0
    """How much of the job's metrics file is in the launcher's already (`sync_metrics`)."""
    limits: tuple[tuple[str, int], ...] = ()
    """The resource limits the holder sets on the job (`Sandbox.job_limits`)."""
    lock: int | None = None
    """A session user's lock (`root/.users/<user>.lock`), held shared while the job runs."""

    def holder_args(self) -> list[str]:
        """The job holder's (`_reaper.py`) options that start the command in this sandbox."""
        args = ["--env-stdin", "--umask", "077", "--cwd", str(self.workdir)]
        if self.user.switch:
            args += ["--user", f"{self.user.uid}:{self.user.gid}"]
        for name, value in self.limits:
            args += ["--rlimit", f"{name}={value}"]
        return args

    def env_bytes(self) -> bytes:
        """The environment as `--env-stdin` reads it: NUL-separated `NAME=value`."""
        return b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in self.env.items())

    def sync_metrics(self, final: bool = False) -> None:
        """Append what the job reported since the last sync to the launcher's file, so its
        learning curve is read while it runs (each read as careful as the last one's)."""
        if self.metrics is not None:
            self.copied = _copy_metrics(*self.metrics, self.user, self.copied, final)

    def finish(self) -> None:
        """Append the rest of the job's metrics to the launcher's file; remove the job's
        folder (its TMPDIR with it); for a session user, when no other job of it runs any
        more, remove what it left in TEMP_DIRS. Only once the job's last process has ended."""
        try:
            self.sync_metrics(final=True)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
            lock, self.lock = self.lock, None
            if lock is not None:
                try:
                    _sweep_leftovers(lock, self.user)
                finally:
                    os.close(lock)


class Redactor:
    """Callable on a log line: each known secret in it becomes `***` (longest first), and so do
    the credentials of any URL (`redact_urls`)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = tuple(sorted({s for s in secrets if s}, key=lambda s: (-len(s), s)))
        self._pattern = re.compile("|".join(map(re.escape, self.secrets))) if self.secrets else None

    def __call__(self, line: str) -> str:
        if self._pattern is not None:
            line = self._pattern.sub("***", line)
        return redact_urls(line)

    @classmethod
    def withheld(
        cls, given: Mapping[str, str], environ: Mapping[str, str] | None = None
    ) -> Redactor:
        """A redactor of what `environ` (the worker's) holds and the job was not `given`."""
        return cls(known_secrets(given, os.environ if environ is None else environ))


def known_secrets(given: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """What the job must not print: each value of `environ` it was not given, of at least
    `MIN_SECRET_LEN` characters, and the password (as written, and decoded) of any URL in
    `environ`. What the job was given, under any name and as part of any value (`PYENV_ROOT`
    inside `PATH`), is its own to print."""
    received = "\0".join(given.values())
    found = []
    for name, value in environ.items():
        if given.get(name) == value:
            continue
        if len(value) >= MIN_SECRET_LEN and value not in received:
            found.append(value)
        for credentials in url_credentials(value):
            password = credentials.partition(":")[2]
            for text in (password, unquote(password)):
                if len(text) >= MIN_PASSWORD_LEN and text not in received:
                    found.append(text)
    return found


# -- helpers ------------------------------------------------------------------------------


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _patterns_may(name: str, value: str) -> bool:
    """Whether an allow-list pattern may pass `name`: none of NEVER_BY_PATTERN matches it (in
    any case), and its value holds no URL credentials."""
    upper = name.upper()
    if any(fnmatch.fnmatchcase(upper, p) for p in NEVER_BY_PATTERN):
        return False
    return not url_credentials(value)


def session_user_name(grant: str | None, prefix: str = SESSION_USER_PREFIX) -> str:
    """The name of an agent session's own user: `prefix` and 12 hex digits of a hash of its
    grant id (jobs without a grant share one). The same grant, on any worker, the same name."""
    digest = hashlib.sha256(b"prefect-gpu-budget agent session\0" + (grant or "").encode())
    return prefix + digest.hexdigest()[:12]


def _lookup_user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _useradd() -> str | None:
    found = [p for p in USERADD if os.access(p, os.X_OK)]
    return found[0] if found else shutil.which("useradd")


def _free_id(first: int, last: int) -> int | None:
    """The lowest id of first..last that is neither a user's uid nor a group's gid."""
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    return next((i for i in range(first, last + 1) if i not in taken), None)


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


LEFTOVER_WAIT_S = 2.0
"""How long the sweep waits for a session user's last processes (just killed) to be gone."""


def _processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose owner is `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except (OSError, IndexError):
            continue
        found.append(int(entry))
    return found


def _sweep_leftovers(lock: int, user: JobUser) -> None:
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
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


def _slug(name: str | None) -> str:
    """A job name as a folder name: `sweep/0003` -> `sweep-0003`."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "").strip(".-")[:40]
    return text or "job"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _warn_own_user(name: str) -> None:
    global _warned_own_user
    with _warn_lock:
        if _warned_own_user:
            return
        _warned_own_user = True
    logger.warning(
        "agent jobs run as this worker's own user %r (environment stripped, a folder of their "
        "own), so they can write whatever that user can: set PREFECT_GPU_BUDGET_AGENT_USER "
        "and run the worker as root to confine them",
        name,
    )


def _package_source() -> str:
    """The folder this package is imported from, for the job's PYTHONPATH (so a trial,
    `python -m prefect_gpu_budget.flows.trial`, imports this very code)."""
    return str(Path(__file__).resolve().parents[2])


def _is_python(program: str) -> bool:
    """Whether `program` is the job's interpreter: a name of PYTHON_NAMES, or this worker's."""
    return program in PYTHON_NAMES or program == sys.executable


def _offer_python(tools: Path, user: JobUser, python: str | None) -> tuple[str | None, str]:
    """Fill `tools` (the worker's, 0755; files 0644): `bin/` with a `python` and a `python3`
    that start `python` (a script that `exec`s it, not a link: a venv's interpreter finds
    its venv only by the path it was started as), and `lib/` with a copy of TRIAL_SOURCES
    when `user` cannot read them where this package is, or when this package is installed
    (its folder, site-packages, holds every other package too, perhaps built for another
    Python). Returns the folder for the job's PATH (None without a `python`) and the one
    for its PYTHONPATH."""
    bin_dir = None
    if python is not None:
        bin_dir = tools / "bin"
        script = f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n'.encode()
        for name in PYTHON_NAMES:
            _write_file(bin_dir / name, script, 0o755)
    source = Path(_package_source())
    if source.name not in ("site-packages", "dist-packages") and all(
        not _unreachable(str(source / rel), user, os.R_OK) for rel in TRIAL_SOURCES
    ):
        return (str(bin_dir) if bin_dir else None), str(source)
    for rel in TRIAL_SOURCES:
        _write_file(tools / "lib" / rel, (source / rel).read_bytes(), 0o644)
    return (str(bin_dir) if bin_dir else None), str(tools / "lib")


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write a new file (never through a link), its folders made 0755, whatever the umask."""
    for folder in reversed([path.parent, *path.parent.parents]):
        if not folder.exists():
            folder.mkdir(mode=0o755)
            os.chmod(folder, 0o755)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)


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


def _unreachable(path: str, user: JobUser, want: int) -> str:
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


def _copy_metrics(
    mine: Path, theirs: Path, user: JobUser, start: int = 0, final: bool = True
) -> int:
    """Append the job's metrics file from `start` to the launcher's: only a regular file of the
    job's user (never a link, a FIFO, or a file of another user linked in), up to
    MAX_METRICS_BYTES of it, and only whole lines (a line still being written waits for the
    next copy, unless `final` or past the bound). Returns how far the file is copied now."""
    try:
        fd = os.open(mine, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return start  # the job removed it: no metrics
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != user.uid:
        os.close(fd)
        logger.warning("job metrics file %s is not the job's own regular file: ignored", mine)
        return MAX_METRICS_BYTES
    with os.fdopen(fd, "rb") as handle:
        handle.seek(start)
        data = handle.read(max(0, MAX_METRICS_BYTES - start))
    if not final and start + len(data) < MAX_METRICS_BYTES:
        data = data[: data.rfind(b"\n") + 1]
    if not data:
        return start
    try:
        with open(theirs, "ab") as out:
            out.write(data)
    except OSError as exc:
        logger.warning("could not copy the job's metrics to %s: %s", theirs, exc)
    return start + len(data)
