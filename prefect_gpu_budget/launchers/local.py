"""Local launcher: the job's command as a subprocess, stopped at max_runtime."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from prefect_gpu_budget import settings
from prefect_gpu_budget.identity import live_processes, process_start_ticks
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    LaunchResult,
    Probe,
    StartHook,
    StartNotRecorded,
    StartRecord,
    SubmitHook,
    ignore_submission,
)
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.sandbox.isolation import HOLDER_SCRIPT
from prefect_gpu_budget.sandbox.job import SandboxedJob
from prefect_gpu_budget.sandbox.launcher import Sandbox
from prefect_gpu_budget.sandbox.limits import OverLimit

JOB_MARK_ENV = "GPU_BUDGET_JOB_MARK"
"""Set, unique, in each local job's environment: what finds a process that left its tree."""
HOLDER_SLACK_S = 5.0
"""How long past the kill grace the holder may take to stop the tree before it is SIGKILLed."""

_granted: set[int] = set()
_granted_lock = threading.Lock()


def visible_gpus() -> list[int]:
    """GPU indices on this machine (from `nvidia-smi -L`); empty without GPUs."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [i for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def grant_gpus(count: int) -> list[int]:
    """Take `count` free GPUs of this machine for one job (within this process)."""
    with _granted_lock:
        free = [g for g in visible_gpus() if g not in _granted]
        take = free[:count]
        _granted.update(take)
        return take


def release_gpus(gpus: list[int]) -> None:
    """Give back GPUs `grant_gpus` took."""
    with _granted_lock:
        _granted.difference_update(gpus)


try:  # looked up before any fork: the child must not load libraries
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: SIGKILL the job if its holder dies, so nothing runs unmetered."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class LocalLauncher:
    """Runs the job's command on this machine, under a job holder (`sandbox/holder.py`); its
    external id is the holder's `pid:start-ticks`.

    Without a `sandbox` (an admin's own jobs) the command gets the worker's environment and
    runs as the worker's user. With one (agents' jobs: `Sandbox.from_env()`) it runs as the
    sandbox's user, in a fresh folder, with a stripped environment and redacted output; a
    sandbox that cannot run the job (root with no agent user, say) refuses it in `preflight`,
    and `run` reports it as a `launch_error`."""

    sandbox: Sandbox | None = None
    machine: str | None = None
    """The `local:NAME` this machine is priced as (default: PREFECT_GPU_BUDGET_LOCAL_MACHINE);
    None: any `local:` type the admin priced. A job naming another type is refused: the price
    is the launcher's, never the spec's (a job run here priced as a cloud's cheap spot VM)."""
    kind: ClassVar[str] = "local"

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        if not job.command:
            raise LaunchConfigError(self.kind, "job has no command to run")
        self._priced_here(job)
        if self.sandbox is not None:
            self.sandbox.check(job)

    def _priced_here(self, job: GpuJob) -> None:
        """Refuse a job that names a type this launcher does not run (`LaunchConfigError`)."""
        mine = self.machine or settings.local_machine()
        if mine is not None and job.instance_type != mine:
            raise LaunchConfigError(
                self.kind,
                f"instance_type: this launcher runs jobs on this machine, priced as {mine}; "
                f"the job names {job.instance_type!r}",
            )
        if not job.instance_type.startswith("local:"):
            raise LaunchConfigError(
                self.kind,
                f"instance_type: the local launcher runs jobs on this machine, priced as a "
                f"local:NAME the admin set (`prefect-gpu-budget prices set-local`), not as "
                f"{job.instance_type!r}: name a launcher that runs that type",
            )

    def run(
        self,
        job: GpuJob,
        quote: Quote,
        *,
        on_start: StartHook = lambda started, pid: None,
        log: Callable[[str], None] = print,
        env: dict[str, str] | None = None,
        on_submit: SubmitHook = ignore_submission,
    ) -> LaunchResult:
        """Run the command; stream its output to `log`; SIGTERM at max_runtime, SIGKILL after grace.

        The job is the whole process tree the command starts: it runs under a job holder
        (`sandbox/holder.py`) that adopts every orphaned descendant, `setsid` ones included,
        and ends only when the last of them has ended, so billing covers them all and
        max_runtime stops them all. The max_runtime clock starts when the process starts; the
        start is recorded meanwhile (`StartRecord`), and the job is stopped if that fails or
        takes longer than its kill grace. (A local process starts when it is submitted:
        `on_start` says all there is.)"""
        refused = self._refusal(job)  # 1. may it run here
        if refused is not None:
            return _launch_error(refused)
        wanted = job.share_of(quote.row).gpus * job.nodes  # 2. its GPUs
        gpus = grant_gpus(wanted)
        if len(gpus) < wanted and visible_gpus():  # a GPU machine, but not enough free GPUs
            release_gpus(gpus)
            return _launch_error(f"fewer than {wanted} GPUs free here")
        mark = uuid.uuid4().hex  # 3. its mark, and the launcher's variables
        extra = {**(env or {}), JOB_MARK_ENV: mark}
        if gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        sandboxed: SandboxedJob | None = None
        try:
            if self.sandbox is not None:  # 4. its sandbox: user, folder, environment
                try:
                    sandboxed = self.sandbox.prepare(job, extra)
                except (LaunchConfigError, OSError) as refused_here:
                    reason = getattr(refused_here, "reason", None) or f"sandbox: {refused_here}"
                    return _launch_error(reason)
                log = _sandboxed_log(log, sandboxed)
            try:  # 5. its holder, started
                proc = _start_holder(job, extra, mark, sandboxed)
            except OSError as exc:
                return _launch_error(f"could not start: {exc}")
            return _follow(proc, job, on_start, log, mark, sandboxed)  # 6. to its end
        finally:
            release_gpus(gpus)
            if sandboxed is not None:
                sandboxed.finish()

    def _refusal(self, job: GpuJob) -> str | None:
        """Why the job cannot run here, in one line (`run`'s `launch_error`): no command, a
        type not run here, the sandbox's refusal, or a program that cannot start; else None."""
        if not job.command:
            return "job has no command to run"
        try:
            self._priced_here(job)
            if self.sandbox is not None:
                self.sandbox.check(job)
        except LaunchConfigError as refused:
            return refused.reason
        if self.sandbox is None:
            missing = _not_runnable(job.command[0])
            if missing:
                return f"could not start: {missing}"
        return None

    def probe(self, external_id: str) -> Probe:
        """`running` when the same process (pid and start time) still runs here; `unknown`
        otherwise: a local process leaves no record of when it ended."""
        return Probe("running") if _live_pid(external_id) is not None else Probe("unknown")

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        pid = _live_pid(external_id)
        if pid is not None:
            stop_pid(pid, grace)


def _launch_error(detail: str) -> LaunchResult:
    """A job that never started: `launch_error`, now, saying why."""
    now = time.time()
    return LaunchResult("launch_error", now, now, detail=detail)


def _start_holder(
    job: GpuJob, extra: dict[str, str], mark: str, sandboxed: SandboxedJob | None
) -> subprocess.Popen:
    """Start the job's holder (`OSError` if it cannot be): an admin's job with the worker's
    environment; a sandboxed one as its sandbox says, its environment handed over stdin."""
    holder = [sys.executable, "-I", "-S", HOLDER_SCRIPT, "--grace", str(job.kill_grace)]
    holder += ["--holder", str(os.getpid())]
    if sandboxed is None:
        holder_env, stdin = {**os.environ, **job.env, **extra}, None
    else:
        holder += sandboxed.holder_args()
        holder_env, stdin = _holder_env(mark), subprocess.PIPE
    holder += ["--", *(sandboxed.command if sandboxed is not None else job.command)]
    proc = subprocess.Popen(
        holder,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=holder_env,
        cwd="/" if sandboxed is not None else None,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    if sandboxed is not None:
        sandboxed.holder_pid = proc.pid
        _send_env(proc, sandboxed)
    return proc


def _follow(
    proc: subprocess.Popen,
    job: GpuJob,
    on_start: StartHook,
    log: Callable[[str], None],
    mark: str,
    sandboxed: SandboxedJob | None,
) -> LaunchResult:
    """Log the started job's output, record its start, wait for its end (`_wait`), and say
    how it ended. Anything left carrying its `mark` is killed once it has."""
    started = time.time()
    reader = threading.Thread(target=_pump, args=(proc, log), daemon=True)
    reader.start()
    external_id = f"{proc.pid}:{process_start_ticks(proc.pid)}"
    try:
        record = StartRecord(on_start, started, external_id, min(job.kill_grace, job.max_runtime))
        tick = sandboxed.tick if sandboxed is not None else None
        code, outcome, detail = _wait(proc, job, record, tick)
    except BaseException:
        _stop(proc, job.kill_grace)
        raise
    finally:
        kill_marked(mark)  # anything that escaped the holder (it was SIGKILLed, say)
    ended = time.time()
    reader.join(timeout=2)
    record.finish()  # the start is on record before the gate settles
    return LaunchResult(
        outcome,
        started,
        ended,
        exit_code=code,
        detail=detail,
        external_id=external_id,
        billed_seconds=_billed(job, outcome, ended - started),
    )


def _live_pid(external_id: str) -> int | None:
    """The pid in `pid:ticks` if that very process still runs (a reused pid never matches)."""
    pid, _, ticks = external_id.partition(":")
    if not pid.isdigit() or not ticks or process_start_ticks(int(pid)) != ticks:
        return None
    return int(pid)


TICK_S = 1.0
"""How often a running job's `tick` (a sandbox's metrics copy) runs."""


def _wait(
    proc: subprocess.Popen,
    job: GpuJob,
    record: StartRecord,
    tick: Callable[[], None] | None = None,
) -> tuple[int | None, str, str]:
    """Wait for the job's last process, timing max_runtime from its real start; stop it at
    max_runtime, or when its start cannot be recorded (`record.check`). `tick` runs about
    every TICK_S meanwhile; the job is stopped, `failed`, when it raises `OverLimit`."""
    deadline = record.started_at + job.max_runtime
    while True:
        if tick is not None:
            try:
                tick()
            except OverLimit as over:  # its folder passed its disk limit, say
                return _stop(proc, job.kill_grace), "failed", over.reason
        now = time.time()
        try:
            record.check(now)
        except StartNotRecorded as late:
            return _stop(proc, job.kill_grace), "cancelled", str(late)
        if now >= deadline:
            code = _stop(proc, job.kill_grace)
            return code, "timed_out", f"stopped at max_runtime {job.max_runtime:.0f}s"
        step = deadline - now if record.done else min(deadline - now, 0.2)
        if tick is not None:
            step = min(step, TICK_S)
        try:
            code = proc.wait(timeout=step)
        except subprocess.TimeoutExpired:
            continue
        return (
            code,
            ("completed" if code == 0 else "failed"),
            ("" if code == 0 else f"exit code {code}"),
        )


def _billed(job: GpuJob, outcome: str, ran_s: float) -> float | None:
    """What a job stopped at max_runtime is billed (`GpuJob.stopped_run_s`: its last process
    was SIGKILLed by then, in its own PID namespace, all of them at once). Any other ending:
    its time as it ran (None)."""
    return job.stopped_run_s(ran_s) if outcome == "timed_out" else None


def _holder_env(mark: str) -> dict[str, str]:
    """A sandboxed job's holder runs with this, none of the job's variables: it may be root,
    and `LD_PRELOAD` from a job's env would run the job's code in it."""
    env = {JOB_MARK_ENV: mark}
    if "LD_LIBRARY_PATH" in os.environ:  # the worker's (an interpreter may need it to start)
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def _send_env(proc: subprocess.Popen, sandboxed: SandboxedJob) -> None:
    """Hand the job's environment to its holder (`--env-stdin`), then close its stdin."""
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # the holder is gone already: its exit tells
        proc.stdin.buffer.write(sandboxed.env_bytes())
        proc.stdin.buffer.flush()
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()


def _sandboxed_log(log: Callable[[str], None], sandboxed: SandboxedJob) -> Callable[[str], None]:
    """`log` for a sandboxed job's output: redacted, and no more than its `output` limit."""

    def shown(line: str) -> None:
        text = sandboxed.output(line)
        if text is not None:
            log(text)

    return shown


def _not_runnable(program: str) -> str:
    """Why `program` cannot be started (the holder would only report exit code 127)."""
    if os.sep in program:
        if not os.path.isfile(program) or not os.access(program, os.X_OK):
            return f"[Errno 2] No such file or directory or not executable: {program!r}"
        return ""
    return "" if shutil.which(program) else f"[Errno 2] No such file or directory: {program!r}"


def marked_processes(name: str, value: str) -> list[int]:
    """Live (not zombie) processes whose environment carries `name=value`: how a process that
    left its job's tree is found. Processes of other users cannot be read."""
    wanted = f"{name}={value}".encode()

    def marked(folder: str) -> bool:
        with open(f"{folder}/environ", "rb") as handle:
            return wanted in handle.read().split(b"\0")

    return live_processes(marked)


def kill_marked(mark: str) -> None:
    """SIGKILL any process still carrying this job's mark in its environment: one that
    escaped the holder's tree (the holder was killed outright, or a descendant re-parented
    itself away)."""
    for pid in marked_processes(JOB_MARK_ENV, mark):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


MAX_OUTPUT_LINE = 16 * 1024
"""The most of one line of a job's output read and logged at once: a job that writes 100 MB
lines costs its worker no more memory than one that writes short ones."""


def _pump(proc: subprocess.Popen, log: Callable[[str], None]) -> None:
    """Log the job's output line by line; a line longer than MAX_OUTPUT_LINE is logged cut, the
    rest of it read in pieces and dropped."""
    assert proc.stdout is not None
    cut = False
    while chunk := proc.stdout.readline(MAX_OUTPUT_LINE):
        whole = chunk.endswith("\n")
        if not cut:
            log(chunk.rstrip("\n") if whole else f"{chunk} [line cut at {MAX_OUTPUT_LINE} chars]")
        cut = not whole


def _stop(proc: subprocess.Popen, grace: float) -> int | None:
    """SIGTERM the job's holder, which stops the whole tree (SIGTERM once to each process,
    grace, SIGKILL), as Slurm signals a job once before its KillWait; SIGKILL the holder's
    process group if it has not ended `HOLDER_SLACK_S` after that. (A SIGTERM to the group
    reached the job twice, directly and from its holder: a second SIGTERM is "abort at once,
    skip the checkpoint" to many training loops.)"""
    for kill, sig, wait in (
        (os.kill, signal.SIGTERM, grace + HOLDER_SLACK_S),
        (os.killpg, signal.SIGKILL, 5.0),
    ):
        try:
            kill(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def stop_pid(pid: int, grace: float = 10.0, *, group: bool = True) -> None:
    """Stop an orphaned job's process group by pid (used by reconcile), or with `group=False`
    the one process: SIGTERM, then SIGKILL once the grace is over."""
    kill = os.killpg if group else os.kill
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace + HOLDER_SLACK_S
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
