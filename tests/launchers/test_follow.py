"""The follow loop that every cloud launcher uses, driven with a scripted job in plain Python:
the loop is control flow only, so no cloud is needed to see it read, stop, wait and end."""

from __future__ import annotations

import threading
import time

import pytest

from prefect_gpu_budget.launchers.base import LaunchResult
from prefect_gpu_budget.launchers.follow import (
    LostTrack,
    Remote,
    Retry,
    Seen,
    Start,
    Stop,
    first_line,
    follow,
    wait_over,
)

POLL = 0.01
FINAL = {"SUCCEEDED": "completed", "FAILED": "failed", "STOPPED": "cancelled"}


class Passing(Exception):
    """A read error the loop is told to ride out."""


class FakeJob(Remote[str]):
    """A job elsewhere: it waits `waits` reads for capacity (QUEUED), runs `runs` reads
    (RUNNING), then ends `final`; asked to stop, it reads STOPPED from the next read on.
    `errors` are raised by the first reads, one each."""

    def __init__(
        self,
        *,
        waits: int = 0,
        runs: int = 2,
        final: str = "SUCCEEDED",
        errors: tuple[Exception, ...] = (),
        runtime: float | None = None,
        max_wait: float | None = None,
        refuse: int = 0,
    ) -> None:
        self.name = "fake job j-1"
        self.waits, self.runs, self.final = waits, runs, final
        self.errors = list(errors)
        self.runtime, self.max_wait = runtime, max_wait
        self.refuse = refuse  # stops that fail to be asked, before one is
        self.reads = self.answered = 0  # reads tried; reads answered (the job's clock)
        self.created = time.time()
        self.started_at: float | None = None
        self.stops: list[Stop] = []
        self.tries = 0
        self.ended: list[tuple[str, float | None, Stop | None]] = []

    def state(self) -> str:
        if self.stops:
            return "STOPPED"
        if self.answered <= self.waits:
            return "QUEUED"
        return "RUNNING" if self.answered <= self.waits + self.runs else self.final

    def read(self) -> Seen[str]:
        self.reads += 1
        if self.errors:
            raise self.errors.pop(0)
        self.answered += 1
        state = self.state()
        if state == "RUNNING" and self.started_at is None:
            self.started_at = time.time()
        return Seen(
            state, state, f"job {state}", self.started_at, state in FINAL, state == "QUEUED"
        )

    def limit(self, started: float | None) -> tuple[float, Stop] | None:
        if started is not None and self.runtime is not None:
            return started + self.runtime, Stop("timed_out", "past max_runtime")
        if started is None and self.max_wait is not None:
            return self.created + self.max_wait, Stop("wait_expired", "no capacity")
        return None

    def stop(self, stop: Stop) -> bool:
        self.tries += 1
        if self.refuse:
            self.refuse -= 1
            return False
        self.stops.append(stop)
        return True

    def end(
        self, seen: Seen[str], started: float | None, stopped: Stop | None, now: float
    ) -> LaunchResult | None:
        if not seen.over:
            return None
        self.ended.append((seen.job, started, stopped))
        outcome = FINAL[seen.job]
        if stopped is not None and outcome != "completed":
            outcome = stopped.outcome  # the outcome the stop asked for
        began = now if started is None else started
        return LaunchResult(outcome, began, now, detail=seen.job, external_id="j-1")


class Told:
    """An `on_start` hook that notes each start it is told of (after `delay` seconds)."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        self.delay, self.error = delay, error
        self.starts: list[tuple[float, str]] = []

    def __call__(self, at: float, external_id: str) -> None:
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        self.starts.append((at, external_id))


def _follow(
    job: FakeJob,
    told: Told | None = None,
    patience: float = 5.0,
    retry: Retry = Retry(),
    remind_s: float | None = None,
) -> tuple[LaunchResult, list[str]]:
    """Follow `job` to its end: its result, and what the loop logged."""
    lines: list[str] = []
    start = Start(told or Told(), "j-1", patience)
    result = follow(job, start, poll_s=POLL, log=lines.append, retry=retry, remind_s=remind_s)
    return result, lines


def test_a_job_that_runs_to_its_end_is_followed_once_through_each_state() -> None:
    told = Told()
    job = FakeJob(waits=2, runs=3)
    result, lines = _follow(job, told)

    assert result.outcome == "completed" and result.detail == "SUCCEEDED"
    assert lines == ["job QUEUED", "job RUNNING", "job SUCCEEDED"]  # each change, once
    assert told.starts == [(job.started_at, "j-1")]  # told once, of the job's own start
    assert result.started_at == job.started_at
    assert job.stops == [] and job.reads == 6


def test_the_start_is_on_record_before_the_loop_returns() -> None:
    """A slow ledger (an on_start that takes a while) never delays the clock, but the result
    is not handed back before the start is recorded: else the job settles as never started."""
    told = Told(delay=0.3)
    result, _ = _follow(FakeJob(runs=1), told)
    assert told.starts == [(result.started_at, "j-1")]


def test_a_job_past_its_limit_is_stopped_once_and_ends_as_the_stop_says() -> None:
    job = FakeJob(runs=10_000, runtime=0.05)
    result, lines = _follow(job)

    assert job.stops == [Stop("timed_out", "past max_runtime")]
    assert job.ended == [("STOPPED", job.started_at, job.stops[0])]
    assert result.outcome == "timed_out"
    assert lines[-1] == "job STOPPED"


def test_a_wait_for_capacity_that_runs_out_is_stopped_as_expired() -> None:
    job = FakeJob(waits=10_000, max_wait=0.05)
    result, lines = _follow(job)

    assert job.stops == [Stop("wait_expired", "no capacity")]
    assert job.ended == [("STOPPED", None, job.stops[0])]  # it never started
    assert result.outcome == "wait_expired"
    assert lines == ["job QUEUED", "job STOPPED"]


def test_a_waiting_job_is_said_again_every_remind_s() -> None:
    job = FakeJob(waits=40, runs=1)
    _, lines = _follow(job, remind_s=0.1)
    assert lines.count("job QUEUED") >= 2
    assert lines.count("job RUNNING") == 1  # only a wait is said again


def test_a_stop_that_could_not_be_asked_is_asked_again_at_the_next_poll() -> None:
    job = FakeJob(runs=10_000, runtime=0.02, refuse=2)
    result, _ = _follow(job)
    assert job.tries == 3 and len(job.stops) == 1
    assert result.outcome == "timed_out"


def test_a_job_over_is_not_stopped_even_past_its_limit() -> None:
    job = FakeJob(runs=0, final="FAILED", max_wait=0.0)  # over at its first read
    result, _ = _follow(job)
    assert job.stops == [] and result.outcome == "failed"


def test_a_start_the_ledger_cannot_record_in_time_stops_the_job_as_cancelled() -> None:
    told = Told(delay=0.5)
    job = FakeJob(runs=10_000, runtime=60)
    result, _ = _follow(job, told, patience=0.05)

    assert len(job.stops) == 1 and job.stops[0].outcome == "cancelled"
    assert "could not be recorded" in job.stops[0].why
    assert result.outcome == "cancelled"
    assert told.starts == [(job.started_at, "j-1")]  # recorded all the same, before the end


def test_a_refused_start_ends_the_loop_with_its_error() -> None:
    """The gate refused the start (the job is no longer admitted): the error goes on out, and
    the launcher stops the job as for any interruption."""
    job = FakeJob(runs=10_000)
    with pytest.raises(RuntimeError, match="not admitted"):
        _follow(job, Told(error=RuntimeError("not admitted")))


def test_passing_read_errors_are_ridden_out_and_said_once() -> None:
    job = FakeJob(runs=1, errors=(Passing("503\nbody"), Passing("503"), Passing("503")))
    result, lines = _follow(job, retry=Retry((Passing,)))

    assert result.outcome == "completed"
    assert lines[0] == "cannot read fake job j-1, retrying: 503"  # the first line only
    assert lines[1:] == ["job RUNNING", "job SUCCEEDED"]


def test_a_bounded_retry_says_each_error_and_gives_up_at_its_limit() -> None:
    job = FakeJob(errors=(Passing("a"), Passing("b"), Passing("c"), Passing("d")))
    lines: list[str] = []
    with pytest.raises(LostTrack, match="lost track of fake job j-1") as raised:
        follow(
            job,
            Start(Told(), "j-1", 5.0),
            poll_s=POLL,
            log=lines.append,
            retry=Retry((Passing,), give_up_after=3),
        )
    assert isinstance(raised.value.__cause__, Passing)
    assert job.reads == 3
    assert lines == [
        f"cannot read fake job j-1 ({n} of 3): {e}" for n, e in zip("123", "abc", strict=True)
    ]


def test_errors_a_retry_does_not_name_go_on_out() -> None:
    job = FakeJob(errors=(ValueError("refused"),))
    with pytest.raises(ValueError, match="refused"):
        _follow(job, retry=Retry((Passing,)))


def test_an_interruption_goes_on_out_of_the_loop() -> None:
    """A cancelled caller (here: a KeyboardInterrupt out of a read) is never swallowed: the
    launcher stops its job and raises it again."""
    job = FakeJob(errors=(KeyboardInterrupt(),))
    with pytest.raises(KeyboardInterrupt):
        _follow(job, retry=Retry((Exception,)))


def test_the_start_is_told_once_whoever_notes_it() -> None:
    told = Told()
    start = Start(told, "j-1", 5.0)
    assert start.at is None
    first = start.note(10.0)
    assert start.note(20.0) is first and start.at == 10.0
    first.finish()
    assert told.starts == [(10.0, "j-1")]


def test_wait_over_reads_until_the_job_ends_or_its_grace_runs_out() -> None:
    reads: list[float] = []

    def over_at_third() -> bool:
        reads.append(time.monotonic())
        return len(reads) >= 3

    assert wait_over(over_at_third, 5.0, 0.01) and len(reads) == 3

    reads.clear()
    began = time.monotonic()
    assert not wait_over(lambda: bool(reads.append(0.0)), 0.1, 0.03)
    assert 0.1 <= time.monotonic() - began < 1.0
    assert 2 <= len(reads) <= 6  # every 0.03 s, and once more at the end of the grace

    assert not wait_over(lambda: False, 0.0, 1.0)  # no grace: read once, not waited


def test_a_job_stopped_from_outside_the_loop_is_followed_to_its_end() -> None:
    """`Launcher.stop` (a preemption, reconcile) stops the job from another thread: the loop
    asks nothing itself, and ends with the job as it reads it."""
    job = FakeJob(runs=10_000)
    results: list[LaunchResult] = []
    loop = threading.Thread(target=lambda: results.append(_follow(job)[0]))
    loop.start()
    assert wait_over(lambda: job.started_at is not None, 5.0, POLL)
    job.stop(Stop("cancelled", "preempted"))
    loop.join(5.0)
    assert results[0].outcome == "cancelled" and results[0].detail == "STOPPED"
    assert job.ended == [("STOPPED", job.started_at, None)]


def test_first_line_hides_credentials_in_urls() -> None:
    error = OSError("GET https://user:secret@api.example/jobs: 503\nmore")
    assert "secret" not in first_line(error)
    assert first_line(error).endswith(": 503")
    assert first_line(ValueError()) == "ValueError"
