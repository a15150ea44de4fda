"""One agent job's sandbox while it runs (`SandboxedJob`, made by `Sandbox.prepare`): how its
holder starts it, what runs every second (its metrics copied, its folder measured), what its
output may be, and what is done once it has ended."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect_gpu_budget import settings
from prefect_gpu_budget.sandbox.env import Redactor
from prefect_gpu_budget.sandbox.holder import descendants
from prefect_gpu_budget.sandbox.isolation import NETWORK_HOST, proxy_of
from prefect_gpu_budget.sandbox.limits import (
    DISK_CHECK_S,
    DISK_RESERVE,
    HOLDER_LIMITS,
    OverLimit,
    folder_bytes,
    private_bytes,
    remove_tree,
    size_text,
    unlinked_bytes,
)
from prefect_gpu_budget.sandbox.users import TEMP_DIRS, JobUser, sweep_leftovers

MAX_METRICS_BYTES = 64 << 20
"""At most this much of a job's metrics file is copied to the launcher's."""

logger = logging.getLogger(__name__)


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
    network: str = "none"
    """`Sandbox.network`: `none`, a proxy's URL, or `host`."""
    printed: int = 0
    """How many bytes of output the job has printed (`output`)."""
    measured_at: float = 0.0
    """When the job's folder was last measured (`tick`)."""
    keep: tuple[str, ...] = ()
    """What the job reads that may lie in a folder it gets a private one of (its
    interpreter's prefix, its code): the holder binds these back in, read-only (`--keep`)."""
    holder_pid: int | None = None
    """The job holder's pid, once started: its processes are measured for what they hold."""
    over: str | None = None
    """Why the job must stop, once a measurement (`measure`) found it past a limit."""
    meter: threading.Thread | None = None
    """The thread of the last measurement (`tick`), once one started."""

    def holder_args(self) -> list[str]:
        """The job holder's (`holder.py`) options that start the command in this sandbox:
        its own PID, network and mount namespaces (`--isolate`), but with `network` `host`
        only its own PID namespace, where the kernel allows."""
        args = ["--env-stdin", "--umask", "077", "--cwd", str(self.workdir)]
        if self.network == NETWORK_HOST:
            args.append("--own-pids")
        else:
            args.append("--isolate")
            proxy = proxy_of(self.network)
            if proxy is not None:
                args += ["--proxy", f"[{proxy[0]}]:{proxy[1]}"]
            for path in self.keep:
                args += ["--keep", path]
            if self.limit("disk") is not None:
                args += ["--tmp-size", str(self.limit("disk"))]
        if self.user.switch:
            args += ["--user", f"{self.user.uid}:{self.user.gid}"]
        for name, value in self.limits:
            if name in HOLDER_LIMITS:
                args += ["--rlimit", f"{name}={value}"]
        return args

    def limit(self, name: str) -> int | None:
        """The job's limit `name` (None: unlimited)."""
        return dict(self.limits).get(name)

    def tick(self, now: float | None = None) -> None:
        """What runs about every second while the job runs: its metrics copied (`sync_metrics`)
        and, every DISK_CHECK_S, what it holds measured in a thread of its own (`measure`), so
        that however long a measurement takes (a job can hold millions of open files) it never
        holds back the stop at max_runtime. `OverLimit` once a measurement found it past its
        `disk` limit, or holding more than DISK_RESERVE while less than that is left free."""
        self.sync_metrics()
        if self.over is not None:
            raise OverLimit(self.over)
        now = time.monotonic() if now is None else now
        measuring = self.meter is not None and self.meter.is_alive()
        if now - self.measured_at < DISK_CHECK_S or measuring:
            return
        self.measured_at = now
        self.meter = threading.Thread(target=self.measure, name="job-disk-meter", daemon=True)
        self.meter.start()

    def measure(self) -> None:
        """Measure what the job holds (`held`) and note in `over` why it must stop, if so."""
        try:
            used = self.held()
            free = shutil.disk_usage(self.workdir).free
        except Exception as exc:  # noqa: BLE001 - a job that cannot be measured is stopped
            self.over = f"stopped: what it holds could not be measured ({type(exc).__name__})"
            return
        cap = self.limit("disk")
        if cap is not None and used > cap:
            self.over = (
                f"stopped: it holds {size_text(used)} on disk (its folder, its own temporary "
                f"folders and the files it keeps open), past its disk limit of "
                f"{size_text(cap)} ({settings.AGENT_LIMIT_ENVS['disk']})"
            )
        elif used > DISK_RESERVE and free < DISK_RESERVE:
            self.over = (
                f"stopped: the worker's disk is nearly full ({size_text(free)} free) and the "
                f"job holds {size_text(used)}"
            )

    def held(self) -> int:
        """What the job holds: its folder; its private temporary folders (isolated), or what
        a session's own user owns in the host's (`host`); and the unlinked files its
        processes keep open or mapped."""
        used = folder_bytes(self.workdir)
        pids = descendants(self.holder_pid) if self.holder_pid is not None else []
        private, devices = private_bytes(pids)
        used += private
        if self.network == NETWORK_HOST and self.user.session:
            used += sum(folder_bytes(Path(d), owner=self.user.uid) for d in TEMP_DIRS)
        return used + unlinked_bytes(pids, skip=devices)

    def output(self, line: str) -> str | None:
        """`line` as the run's logs show it (redacted), or None once the job has printed more
        than its `output` limit (the first line past it says so instead)."""
        cap = self.limit("output")
        before, self.printed = self.printed, self.printed + len(line) + 1
        if cap is None or self.printed <= cap:
            return self.redact(line)
        if before <= cap:
            return (
                f"(the job printed more than its output limit of {size_text(cap)} "
                f"({settings.AGENT_LIMIT_ENVS['output']}): the rest is not kept)"
            )
        return None

    def env_bytes(self) -> bytes:
        """The environment as `--env-stdin` reads it: NUL-separated `NAME=value`."""
        return b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in self.env.items())

    def sync_metrics(self, final: bool = False) -> None:
        """Append what the job reported since the last sync to the launcher's file, so its
        learning curve is read while it runs (each read as careful as the last one's)."""
        if self.metrics is not None:
            self.copied = copy_metrics(*self.metrics, self.user, self.copied, final)

    def finish(self) -> None:
        """Append the rest of the job's metrics to the launcher's file; remove the job's
        folder (its TMPDIR with it); for a session user, when no other job of it runs any
        more, remove what it left in TEMP_DIRS. Only once the job's last process has ended."""
        try:
            self.sync_metrics(final=True)
        finally:
            remove_tree(self.workdir)
            lock, self.lock = self.lock, None
            if lock is not None:
                try:
                    sweep_leftovers(lock, self.user)
                finally:
                    os.close(lock)


def copy_metrics(
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
