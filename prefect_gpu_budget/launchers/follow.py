"""One follow loop for a job that runs elsewhere: a Vertex AI custom job, a SageMaker training
job, a deployment's flow run.

A launcher creates its job, then hands `follow` a `Remote`, which says only what differs from
one place to another: how to read the job (`Remote.read`, as a `Seen`), when it must be
stopped (`Remote.limit`), how to stop it (`Remote.stop`) and when its bill ends, as what
(`Remote.end`). The loop does the rest, the same way for each:

- it reads the job every `poll_s` seconds; a read error the `Retry` names as passing is
  ridden out (said, and read again at the next poll), up to its `give_up_after` in a row;
- it tells the gate of the start once, the first time a read shows one (`Start`, in a thread
  of its own: a stalled ledger never delays the max_runtime clock), and, before it returns,
  waits for the start to be on record;
- it logs each change of the job's state, and, while the job waits for capacity, its state
  again every `remind_s`;
- while the job has not ended it stops it once: when its start cannot be recorded in time
  (`cancelled`), or at the remote's limit (`timed_out` at max_runtime, `wait_expired` when its
  wait for capacity ran out); a stop that could not be asked is asked again at the next poll;
- it returns the remote's result once the remote says the job's bill may end.

Whatever interrupts the loop (the calling run cancelled: any `BaseException`) goes on out of
it: the launcher stops the job itself. A stop asked from outside the loop (`Launcher.stop`:
reconcile, a preemption, an owner's stop) asks the job to stop, then `wait_over` its grace.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prefect_gpu_budget.launchers.base import LaunchResult, StartHook, StartNotRecorded, StartRecord
from prefect_gpu_budget.units import redact_urls

T = TypeVar("T")


def first_line(exc: BaseException) -> str:
    """An error in one line (its first), without the credentials of any URL in it."""
    text = redact_urls(str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True)
class Seen(Generic[T]):
    """One read of the job, as the loop needs it."""

    job: T
    """The remote's own record of the job, as read (for its `Remote.end`)."""
    state: Hashable
    """A change of it is logged (`line`); None: nothing to log."""
    line: str
    started_at: float | None
    """When it started (its bill began); None while it has not."""
    over: bool
    """It says it has ended: the loop stops it no more."""
    waiting: bool = False
    """It waits for capacity: `line` is logged again every `remind_s`."""


@dataclass(frozen=True)
class Stop:
    """A stop the loop asks of the job: the outcome it is asked for, and why."""

    outcome: str
    """`cancelled` (its start could not be recorded), `timed_out` or `wait_expired`."""
    why: str


@dataclass(frozen=True)
class Retry:
    """Which read errors are passing, and how many in a row are ridden out."""

    errors: tuple[type[Exception], ...] = ()
    give_up_after: int | None = None
    """Raise `LostTrack` at this many failed reads in a row; None: never give up."""


class LostTrack(RuntimeError):
    """The job could not be read `Retry.give_up_after` times in a row."""


class Start:
    """The job's start, told to the gate once (`StartRecord`), whoever sees it first: the loop,
    or a launcher that learns of it while it handles an interruption."""

    def __init__(self, on_start: StartHook, external_id: str, patience: float) -> None:
        self.on_start = on_start
        self.external_id = external_id
        self.patience = patience
        """How long the start may take to be recorded (the job's kill grace)."""
        self.record: StartRecord | None = None

    @property
    def at(self) -> float | None:
        """When the job started; None while no start was seen."""
        return None if self.record is None else self.record.started_at

    def note(self, at: float) -> StartRecord:
        """Tell the gate the job started at `at` (once: a later call returns the first
        record)."""
        if self.record is None:
            self.record = StartRecord(self.on_start, at, self.external_id, self.patience)
        return self.record


class Remote(ABC, Generic[T]):
    """What the loop needs of one job, as its launcher reads and stops it."""

    name: str
    """The job in a log line, e.g. `Vertex AI job <name>`."""

    @abstractmethod
    def read(self) -> Seen[T]:
        """Read the job once; raise when it cannot be read."""

    @abstractmethod
    def stop(self, stop: Stop) -> bool:
        """Ask the job to stop (and say so); False if it could not be asked (asked again at
        the next poll)."""

    def limit(self, started: float | None) -> tuple[float, Stop] | None:
        """When the job, started at `started` (None: not yet), must be stopped, and as what;
        None when nothing stops it from here."""
        return None

    @abstractmethod
    def end(
        self, seen: Seen[T], started: float | None, stopped: Stop | None, now: float
    ) -> LaunchResult | None:
        """The job's result once its bill may end, else None (poll again): once it says it has
        ended (`Seen.over`), or later for a job whose word on its end is no evidence. `started`
        is when the loop saw it start (None: not yet), `stopped` the stop the loop asked of it."""


def follow(
    remote: Remote[T],
    start: Start,
    *,
    poll_s: float,
    log: Callable[[str], None],
    retry: Retry = Retry(),
    remind_s: float | None = None,
) -> LaunchResult:
    """Follow the job until its bill may end, and return its result (see the module's
    docstring)."""
    stopped: Stop | None = None
    told: Hashable = None
    told_at = 0.0
    errors = 0
    while True:
        try:
            seen = remote.read()
            errors = 0
        except retry.errors as exc:
            errors += 1
            _say_unreadable(remote, retry, errors, exc, log)
            time.sleep(poll_s)
            continue
        now = time.time()
        if start.record is None and seen.started_at is not None:
            start.note(seen.started_at)  # max_runtime counts from here, whatever the ledger does
        remind = seen.waiting and remind_s is not None and now - told_at >= remind_s
        if seen.state is not None and (seen.state != told or remind):
            log(seen.line)
            told, told_at = seen.state, now
        stopped = _stop_if_due(remote, seen, start, stopped, now)
        result = remote.end(seen, start.at, stopped, now)
        if result is not None:
            if start.record is not None:
                start.record.finish()  # on record before the gate settles
            return result
        time.sleep(poll_s)


def _say_unreadable(
    remote: Remote[T], retry: Retry, errors: int, exc: BaseException, log: Callable[[str], None]
) -> None:
    """Say the job could not be read: each time when `retry` gives up after a count (raising
    `LostTrack` at it), else once, riding it out for as long as it takes."""
    if retry.give_up_after is not None:  # say each: it counts towards giving up
        most = retry.give_up_after
        log(f"cannot read {remote.name} ({errors} of {most}): {first_line(exc)}")
        if errors >= most:
            raise LostTrack(f"lost track of {remote.name}") from exc
    elif errors == 1:
        log(f"cannot read {remote.name}, retrying: {first_line(exc)}")


def _stop_if_due(
    remote: Remote[T], seen: Seen[T], start: Start, stopped: Stop | None, now: float
) -> Stop | None:
    """The stop asked of the job so far: `stopped`, or, for a job not over and not yet
    stopped, a cancel when its start could not be recorded in time, or its limit once due."""
    if not seen.over and stopped is None and start.record is not None:
        try:
            start.record.check(now)
        except StartNotRecorded as late:
            stopped = _ask(remote, Stop("cancelled", str(late)))
    limit = None if seen.over or stopped is not None else remote.limit(start.at)
    if limit is not None and now >= limit[0]:
        stopped = _ask(remote, limit[1])
    return stopped


def _ask(remote: Remote[T], stop: Stop) -> Stop | None:
    """`stop` once the remote has asked the job to stop; None if it could not."""
    return stop if remote.stop(stop) else None


def wait_over(over: Callable[[], bool], timeout: float, every: float) -> bool:
    """Read `over` (at least once) until it is true or `timeout` seconds have passed, every
    `every` seconds; whether the job ended. What `Launcher.stop` waits, once it asked the job
    to stop: its grace."""
    deadline = time.monotonic() + timeout
    while True:
        if over():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(every, left))
