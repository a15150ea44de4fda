"""The sandbox agents' local jobs run in: another user, a stripped environment, a fresh folder.

An agent's command must not see the worker's secrets (the ledger URL and its password, cloud
keys, Prefect's auth string) nor act as the worker. `LocalLauncher(sandbox=Sandbox.from_env())`
runs it

- as an unprivileged user, started by the job holder, which stays the worker's user (root), so
  the job cannot kill or trace it: with a uid range (`PREFECT_GPU_BUDGET_AGENT_UIDS`), a user
  of the agent session's own (`session_user_name` of the job's grant, `gpub-<12 hex>`, made
  with `useradd` from a uid of the range never given out before, its own group, no home, no
  login, then reused for every job of that grant), so agents cannot signal, trace or read each
  other's jobs, folders or files; else the one user `PREFECT_GPU_BUDGET_AGENT_USER`, which every agent
  shares. The users, their locks and their leftovers: `users.py`;
- within resource limits (`DEFAULT_LIMITS`, `PREFECT_GPU_BUDGET_AGENT_LIMIT_*`, `limits.py`):
  processes, open files, file size, address space, set by the holder on the job's processes
  only;
- with only allow-listed names of the worker's environment (`DEFAULT_ENV_ALLOW`, plus
  `PREFECT_GPU_BUDGET_AGENT_ENV`; the lists: `env.py`), `HOME` set to its own folder,
  the `PYTHONPATH` this package needs, and the job's and launcher's own variables;
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
  instead. Its PYTHONPATH reaches the trial runner (`python -m prefect_gpu_budget.sweeps.trial`,
  standard library only): this package's source checkout where the user can read it, else
  (installed, or out of reach) a copy of the few files the runner imports (`TRIAL_SOURCES`).
  Both live in the job's folder, in `.gpu-budget/` (the worker's, 0755): `interpreter.py`;
- with its output redacted (`Redactor`, `env.py`): any value of the worker's environment
  the job was not given, and the password of any URL there, shows as `***`.

The metrics file the launcher names (`GPU_BUDGET_METRICS_FILE`) is, for the job, a file in its
own folder; when the job has ended, what it wrote is appended to the launcher's file. So the
job needs no access to the worker's results folder, and no file outside `root` is ever left
to the job's user.

Nothing here imports Prefect: the settings come from `prefect_gpu_budget.settings`.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prefect_gpu_budget import settings
from prefect_gpu_budget.job import GpuJob, LaunchConfigError
from prefect_gpu_budget.sandbox import interpreter as job_python
from prefect_gpu_budget.sandbox.env import DEFAULT_ENV_ALLOW, Redactor, allowed_env
from prefect_gpu_budget.sandbox.isolation import (
    NETWORK_HOST,
    PROXY_ENVS,
    isolation_refused,
    proxy_of,
)
from prefect_gpu_budget.sandbox.job import SandboxedJob
from prefect_gpu_budget.sandbox.limits import (
    DEFAULT_LIMITS,
    parse_limits,
)
from prefect_gpu_budget.sandbox.spawn import PROXY_PORT
from prefect_gpu_budget.sandbox.users import (
    SESSION_USER_PREFIX,
    JobUser,
    hold_user_lock,
    session_user,
    uid_range,
    unreachable,
    user_name,
)

SYSTEM_PYTHONS: tuple[str, ...] = ("/usr/bin/python3", "/usr/local/bin/python3")
"""Where an interpreter for the job is looked for when this worker's own is out of its reach."""
ROOT_REFUSED = (
    "agent jobs do not run as root: set PREFECT_GPU_BUDGET_AGENT_USER to an unprivileged user "
    "(or PREFECT_GPU_BUDGET_AGENT_ALLOW_ROOT=1)"
)
logger = logging.getLogger(__name__)
_warned_own_user = False
_warn_lock = threading.Lock()


def _refuse(reason: str) -> LaunchConfigError:
    return LaunchConfigError("local", reason)


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
    network: str = "none"
    """`none`: a network namespace of the job's own, only its own loopback; an HTTP(S) proxy's
    URL: that proxy its one way out; `host` (the opt-out): the host's network and /proc."""

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
        object.__setattr__(self, "network", (self.network or "").strip() or "none")

    @classmethod
    def from_env(cls) -> Sandbox:
        """The admin's settings: PREFECT_GPU_BUDGET_AGENT_USER, _AGENT_ALLOW_ROOT, _AGENT_ENV
        (added to `DEFAULT_ENV_ALLOW`), _AGENT_ROOT, _AGENT_PYTHON, _AGENT_UIDS, _AGENT_NETWORK
        and _AGENT_LIMIT_* (checked when a job is: a bad one refuses it in one line)."""
        extra = tuple(n for n in settings.agent_env_extra() if n not in DEFAULT_ENV_ALLOW)
        return cls(
            user=settings.agent_user(),
            allow_root=settings.agent_allow_root(),
            env_allow=DEFAULT_ENV_ALLOW + extra,
            root=settings.agent_jobs_root(),
            python=settings.agent_python(),
            uids=settings.agent_uids(),
            limits=tuple(settings.agent_limits().items()),
            network=settings.agent_network(),
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
            me = JobUser(user_name(euid), euid, os.getegid(), switch=False)
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
                f"{user_name(euid)!r}, not root, so it cannot switch user"
            )
        return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=True)

    def session_user(self, grant: str | None, *, create: bool = False) -> JobUser:
        """The user of an agent session (its grant; jobs with none share one user) from the
        range `uids` (`users.session_user`): with `create` made if missing. Not made
        yet and not `create`: uid and gid -1. `LaunchConfigError` if the worker is not root,
        the range or the prefix is bad, the name is taken outside the range, or no uid of the
        range is free."""
        return session_user(grant, self.uids, self.user_prefix, self.root, create=create)

    def uid_range(self) -> tuple[int, int]:
        """`uids` as (first, last); `LaunchConfigError` naming the setting if it is bad."""
        return uid_range(self.uids)

    def job_limits(self) -> tuple[tuple[str, int], ...]:
        """The job's resource limits that bound it (unlimited ones left out), by name;
        `LaunchConfigError` naming the setting for a bad one."""
        return parse_limits(self.limits)

    def check_isolation(self) -> None:
        """`LaunchConfigError` (one line) for a bad `network`, or when the job's own network
        and /proc are wanted (any `network` but `host`) and this host cannot give them."""
        proxy_of(self.network)
        if self.network == NETWORK_HOST:
            return
        why = isolation_refused(os.geteuid())
        if why:
            raise _refuse(
                f"agent jobs get a network and a /proc of their own, and this host refuses "
                f"them ({why}): run the worker as root (or allow user namespaces), or set "
                f"{settings.AGENT_NETWORK_ENV}=host to run them on the host's network"
            )

    def interpreter(self, user: JobUser) -> str | None:
        """The Python the job's `python` starts: `self.python` (`LaunchConfigError` if `user`
        cannot run it), else this worker's own, else the first of SYSTEM_PYTHONS, that `user`
        can reach and execute; None if none."""
        if self.python is not None:
            found = shutil.which(self.python) or ""
            why = unreachable(found, user, os.X_OK) if found else "no such program here"
            if why:
                raise _refuse(
                    f"cannot run {settings.AGENT_PYTHON_ENV}={self.python} as {user.name!r}: {why}"
                )
            return os.path.abspath(found)
        for candidate in (sys.executable, *SYSTEM_PYTHONS):
            found = shutil.which(candidate) if candidate else None
            if found and not unreachable(found, user, os.X_OK):
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
        self.check_isolation()
        self._ensure_root(user)
        if create and user.session and user.uid < 0:
            user = self.session_user(job.grant if job is not None else None, create=True)
        python = self.interpreter(user)
        if job is not None and job.command and job_python.is_python(job.command[0]):
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
            why = unreachable(found, user, os.X_OK)
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
        why = unreachable(str(root), user, os.X_OK)
        if why:
            raise _refuse(f"the agent jobs folder {root} is out of {user.name!r}'s reach: {why}")

    # -- what the job gets ----------------------------------------------------------------

    def allowed_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The names of `environ` (the worker's) that the allow-list lets through."""
        return allowed_env(self.env_allow, os.environ if environ is None else environ)

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
        source = job_python.package_source() if source is None else source
        python_path = os.pathsep.join(p for p in (source, allowed.get("PYTHONPATH", "")) if p)
        own = {"HOME": str(workdir), "TMPDIR": str(workdir / "tmp"), "PYTHONPATH": python_path}
        if proxy_of(self.network) is not None:  # the relay on the job's own loopback
            own.update(dict.fromkeys(PROXY_ENVS, f"http://127.0.0.1:{PROXY_PORT}"))
        env = {**allowed, **own, **job.env, **extra}
        if bin_dir:
            env["PATH"] = os.pathsep.join((bin_dir, env.get("PATH") or os.defpath))
        return env

    def prepare(self, job: GpuJob, extra: Mapping[str, str]) -> SandboxedJob:
        """Check (`check`), then make the job's folder and environment. `extra`: the
        launcher's variables (the holder's mark, `GPU_BUDGET_METRICS_FILE`, GPUs). The
        caller calls `finish` once every process of the job has ended."""
        user, python = self._checked(job, create=True)  # 1. may it run, and as whom
        limits = self.job_limits()
        environ = dict(os.environ)
        lock = None
        if user.session:  # held while the job runs: its user's leftovers stay until the last ends
            lock = hold_user_lock(self.root, user)
        try:  # 2. its folder
            workdir = Path(tempfile.mkdtemp(prefix=f"{_slug(job.name)}-", dir=self.root))
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise
        try:  # 3. its temp folder, metrics file, Python and environment
            extra = dict(extra)
            metrics = _own_files(workdir, user, extra)
            bin_dir, source = job_python.offer_python(workdir / job_python.TOOLS_DIR, user, python)
            env = self.job_env(workdir, job, extra, environ, source=source, bin_dir=bin_dir)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            if lock is not None:
                os.close(lock)
            raise
        command = list(job.command or ())  # 4. its command, and what it reads
        if python and command and command[0] == sys.executable:  # a `callable:` trial
            command[0] = python
        keep = _read_paths(python, env.get("PYTHONPATH", ""), command)
        redact = Redactor.withheld(env, environ)
        return SandboxedJob(
            user,
            workdir,
            env,
            redact,
            metrics,
            command,
            limits=limits,
            lock=lock,
            network=self.network,
            keep=keep,
        )


# -- helpers ------------------------------------------------------------------------------


def _slug(name: str | None) -> str:
    """A job name as a folder name: `sweep/0003` -> `sweep-0003`."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "").strip(".-")[:40]
    return text or "job"


def _own_files(workdir: Path, user: JobUser, extra: dict[str, str]) -> tuple[Path, Path] | None:
    """Make the job's folder, its `tmp/` and, where `extra` names the launcher's metrics file,
    a metrics file of its own (pointed at in `extra`) the job's user's. Returns (the job's
    metrics file, the launcher's), or None."""
    if user.switch:
        os.chown(workdir, user.uid, user.gid)
    tmp = workdir / "tmp"
    tmp.mkdir(mode=0o700)
    if user.switch:
        os.chown(tmp, user.uid, user.gid)
    if not extra.get(settings.METRICS_ENV):
        return None
    mine = workdir / "metrics.jsonl"
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if user.switch:
            os.fchown(fd, user.uid, user.gid)
    finally:
        os.close(fd)
    metrics = (mine, Path(extra[settings.METRICS_ENV]))
    extra[settings.METRICS_ENV] = str(mine)
    return metrics


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


def _read_paths(python: str | None, python_path: str, command: list[str]) -> tuple[str, ...]:
    """What the job reads outside its own folder: its interpreter's prefix (where it is and
    where its link leads), its code (each folder of its `python_path`) and its program's
    folder. The holder binds those that lie in a folder the job gets a private one of (/tmp,
    say) back in."""
    paths = []
    for exe in (python, os.path.realpath(python)) if python else ():
        folder = Path(exe).parent
        paths.append(str(folder.parent if folder.name == "bin" else folder))
    paths += [p for p in python_path.split(os.pathsep) if os.path.isabs(p)]
    if command and os.path.isabs(command[0]):
        paths.append(str(Path(command[0]).parent))
    return tuple(dict.fromkeys(paths))
