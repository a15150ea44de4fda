"""The sandbox agents' local jobs run in: another user, a stripped environment, a fresh folder.

An agent's command must not see the worker's secrets (the ledger URL and its password, cloud
keys, Prefect's auth string) nor act as the worker. `LocalLauncher(sandbox=Sandbox.from_env())`
runs it

- as an unprivileged user (`PREFECT_GPU_BUDGET_AGENT_USER`), started by the job holder, which
  stays the worker's user (root), so the job cannot kill or trace it;
- with only allow-listed names of the worker's environment (`DEFAULT_ENV_ALLOW`, plus
  `PREFECT_GPU_BUDGET_AGENT_ENV`), `HOME` set to its own folder, the `PYTHONPATH` this
  package needs, and the job's and launcher's own variables;
- in a fresh folder of its own, `root/<job name>-<random>` (0700, the job user's), removed
  when the job ends: `root` is 0711, so no user can list the other jobs' folders;
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

import fnmatch
import logging
import os
import pwd
import re
import shlex
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
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
    "AZURE_*",
    "*SECRET*",
    "*TOKEN*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*_KEY",
    "*_KEY_*",
)
"""Names an allow-list pattern (`LC_*`, even `*`) never lets through: only an exact name does."""
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "user", (self.user or "").strip() or None)
        object.__setattr__(self, "python", (self.python or "").strip() or None)
        object.__setattr__(self, "env_allow", tuple(self.env_allow))
        object.__setattr__(self, "root", Path(os.path.abspath(self.root)))

    @classmethod
    def from_env(cls) -> Sandbox:
        """The admin's settings: PREFECT_GPU_BUDGET_AGENT_USER, _AGENT_ALLOW_ROOT, _AGENT_ENV
        (added to `DEFAULT_ENV_ALLOW`), _AGENT_ROOT and _AGENT_PYTHON."""
        extra = tuple(n for n in settings.agent_env_extra() if n not in DEFAULT_ENV_ALLOW)
        return cls(
            user=settings.agent_user(),
            allow_root=settings.agent_allow_root(),
            env_allow=DEFAULT_ENV_ALLOW + extra,
            root=settings.agent_jobs_root(),
            python=settings.agent_python(),
        )

    # -- may it run? ----------------------------------------------------------------------

    def job_user(self) -> JobUser:
        """Who the job runs as; `LaunchConfigError` with a one-line reason if nobody may."""
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

    def _checked(self, job: GpuJob | None) -> tuple[JobUser, str | None]:
        """`check`, and the job's interpreter."""
        user = self.job_user()
        self._ensure_root(user)
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
            or (
                any(fnmatch.fnmatchcase(name, p) for p in patterns)
                and not any(fnmatch.fnmatchcase(name, p) for p in NEVER_BY_PATTERN)
            )
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
        """The job's whole environment: the allowed names, `HOME` (its folder), `PYTHONPATH`
        (`source`, default this package's, then the worker's if allowed), `job.env`, then
        `extra` (the launcher's variables); `bin_dir` first on its PATH."""
        allowed = self.allowed_env(environ)
        source = _package_source() if source is None else source
        python_path = os.pathsep.join(p for p in (source, allowed.get("PYTHONPATH", "")) if p)
        env = {**allowed, "HOME": str(workdir), "PYTHONPATH": python_path, **job.env, **extra}
        if bin_dir:
            env["PATH"] = os.pathsep.join((bin_dir, env.get("PATH") or os.defpath))
        return env

    def prepare(self, job: GpuJob, extra: Mapping[str, str]) -> SandboxedJob:
        """Check (`check`), then make the job's folder and environment. `extra`: the
        launcher's variables (the holder's mark, `GPU_BUDGET_METRICS_FILE`, GPUs). The
        caller calls `finish` once every process of the job has ended."""
        user, python = self._checked(job)
        environ = dict(os.environ)
        workdir = Path(tempfile.mkdtemp(prefix=f"{_slug(job.name)}-", dir=self.root))
        try:
            if user.switch:
                os.chown(workdir, user.uid, user.gid)
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
            raise
        command = list(job.command or ())
        if python and command and command[0] == sys.executable:  # a `callable:` trial
            command[0] = python
        return SandboxedJob(user, workdir, env, Redactor.withheld(env, environ), metrics, command)


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

    def holder_args(self) -> list[str]:
        """The job holder's (`_reaper.py`) options that start the command in this sandbox."""
        args = ["--env-stdin", "--umask", "077", "--cwd", str(self.workdir)]
        if self.user.switch:
            args += ["--user", f"{self.user.uid}:{self.user.gid}"]
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
        folder. Only once the job's last process has ended."""
        try:
            self.sync_metrics(final=True)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


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
