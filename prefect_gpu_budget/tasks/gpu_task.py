"""`@gpu_task`: a Prefect task whose every run passes the gate, runs its body, and settles once.

```python
@gpu_task(instance_type="local:a100x1", scope="acme/vision/agent-7", max_runtime="2h")
def train(lr: float) -> float: ...
```

Each run (a call, `.submit`, each element of `.map`, each retry) is one admission: the task run
shows `AwaitingBudget` while it waits and Running once admitted, and the body never starts
before. The job settles once whatever way the body ends: it returns (`completed`), raises
(`failed`, and Prefect's retries apply, each a new admission), is cancelled (`cancelled`), or
runs past `max_runtime` (`timed_out`: stopped, it pays for what it ran, and the run ends
`TimedOut`). A refusal ends the run `OverBudget` or `AdmissionTimeout` and is never retried.

Settings are `GpuJob`'s fields plus `scope` and `ledger` (a `SpendLedger`): given to the
decorator, to `.with_options(gpu={...})`, or to one call as `gpu={...}` (in `.map`, wrap that
dict in `prefect.unmapped`), each winning over the one before; what none of them gives comes
from the flow's `job_defaults(...)` (`tasks.defaults`), whose scope, ledger and agent grant
bound the task: a task that would spend outside them ends `GateRefused`, nothing reserved. Inside the body, `current_job()` says which job it is and which
GPUs of this machine it was given (in this process no other job is given the same ones).

The body runs in the task's own process, and is stopped by an exception raised in its thread
(Prefect's cancel scope: a signal in the main thread, an injected exception in another), so a
body blocked in C code stops when it returns to Python, and pays until then: at `max_runtime`
(`TimedOut`), when the capacity it borrowed in a pool is taken back by a job within its lender's
quota (settled `preempted`; with `requeue`, as by default, it is queued again and runs again
from the start once admitted, as a preempted command does; else it ends `Preempted`), or when
its owner stops it (`cancelled`, the run Cancelled). A body that must checkpoint saves as it
goes, or runs as a command through `run_gpu_job` (SIGTERM, then its `kill_grace`). A preempted
or stopped body is never retried as if it failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prefect import Task
from prefect._internal.concurrency.cancellation import (
    CancelledError,
    cancel_async_after,
    cancel_sync_after,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger
from prefect.states import Failed, State

from prefect_gpu_budget.admission.gate import AdmissionRefused
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.lifecycle import FAILED, PastMaxRuntime, Running, StopAsked
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import grant_gpus, release_gpus, visible_gpus
from prefect_gpu_budget.tasks.defaults import current_defaults
from prefect_gpu_budget.tasks.events import stopped_state
from prefect_gpu_budget.tasks.gpu_job import current_flow_run_id, gate_for_run, placed
from prefect_gpu_budget.units import BudgetInputError, fmt_duration, validate_scope

REFUSED_STATES = frozenset({"OverBudget", "AdmissionTimeout", "GateRefused"})
FINAL_STATES = REFUSED_STATES | {"Preempted"}
"""States no retry follows: a refusal by the budget, a preemption (`requeue` decides whether
the body runs again). A stop by its owner ends Cancelled, which Prefect never retries."""
SETTINGS = frozenset(GpuJob.model_fields) - {"command", "env", "grant"} | {"scope", "ledger"}
"""What `gpu_task`, `.with_options(gpu=...)` and a call's `gpu=` may set."""


@dataclass(frozen=True)
class CurrentJob:
    """The admitted job a `@gpu_task` body runs as."""

    job_id: str
    scope: str
    instance_type: str
    gpus: tuple[int, ...]
    """This machine's GPU indices given to the job (empty on a machine without GPUs)."""
    rate_usd_per_hour: float
    deadline: float
    """When `max_runtime` runs out (seconds since the epoch)."""


_current: ContextVar[CurrentJob | None] = ContextVar("gpu_budget_current_job", default=None)


def current_job() -> CurrentJob:
    """The job of the `@gpu_task` body that calls it."""
    found = _current.get()
    if found is None:
        raise RuntimeError("current_job() is known only inside the body of a @gpu_task")
    return found


def _settings(given: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    unknown = sorted(set(given or {}) - SETTINGS)
    if unknown:
        raise BudgetInputError(
            where, f"unknown setting {unknown[0]!r}; known: scope, ledger, and GpuJob's fields"
        )
    return dict(given or {})


class _GatedRun:
    """One run of a `@gpu_task`: admit, give it GPUs, run the body as a stoppable `Running`
    job, settle once; again from the admission when a preemption requeues it."""

    def __init__(self, settings: Mapping[str, Any], task_name: str) -> None:
        fields, grant, self.refusal = current_defaults().apply(settings)
        scope, self.ledger = fields.pop("scope", None), fields.pop("ledger", None)
        if not scope:
            raise BudgetInputError(
                "scope",
                "a @gpu_task needs a scope: give it to gpu_task, .with_options(gpu=...), "
                "the call's gpu={...} or the flow's job_defaults(...)",
            )
        self.scope = validate_scope(scope)
        self.job = GpuJob(**{"name": task_name, **fields, "grant": grant})
        self.admission: Admission | None = None
        self.running: Running | None = None
        self.gpus: list[int] = []
        self.started_at = 0.0
        if not self.refusal:  # a refused run opens no ledger
            self.gate = gate_for_run(self.scope, self.job, self.ledger)

    def admit(self) -> State | None:
        """Wait for admission; the refusal's state if refused. Then the job starts now."""
        if self.refusal:  # settings its flow does not allow: nothing is reserved
            return Failed(name="GateRefused", message=self.refusal)
        try:  # the body runs here: a job asking for accelerators goes to a pool's machine
            say = get_run_logger().info
            self.job, _ = placed(self.job, self.scope, self.gate, say, launcher="local")
        except BudgetInputError as unplaceable:
            return Failed(name="Unplaceable", message=str(unplaceable))
        try:
            self.admission = self.gate.admit(
                self.job, self.scope, flow_run_id=current_flow_run_id(), launcher="task"
            )
        except AdmissionRefused as refused:
            return Failed(name=refused.state_name, message=refused.reason)
        # the body's own cancel scope stops it at max_runtime (`stoppable`)
        self.running = Running(self.gate, self.admission, then=self._release_gpus)
        share = self.job.share_of(self.admission.quote.row)
        wanted = share.gpus * self.job.nodes
        self.gpus = grant_gpus(wanted)
        self.started_at = time.time()
        if len(self.gpus) < wanted and visible_gpus():
            self.running.settlement.settle(FAILED)
            return Failed(name="GpuJobFailed", message=f"fewer than {wanted} GPUs free here")
        ctx = TaskRunContext.get()
        run_id = str(ctx.task_run.id) if ctx else self.admission.job_id
        self.running.started(self.started_at, f"task:{run_id}")
        return None

    def current(self) -> CurrentJob:
        assert self.admission is not None
        return CurrentJob(
            job_id=self.admission.job_id,
            scope=self.scope,
            instance_type=self.job.instance_type,
            gpus=tuple(self.gpus),
            rate_usd_per_hour=self.admission.quote.rate_micro_per_hour / 1e6,
            deadline=self.started_at + self.job.max_runtime,
        )

    @contextmanager
    def stoppable(self, cancel_after: Callable[[float], Any]) -> Iterator[None]:
        """Run the body inside Prefect's cancel scope (`cancel_after`: the one its `timeout`
        utilities use, sync or async), which times out at max_runtime and which the job's stop
        cancels too (`Running.stoppable`): the body's thread gets an exception, raised out of
        here as `PastMaxRuntime` (the scope's own timeout) or `StopAsked` (preempted, or
        stopped by its owner)."""
        assert self.running is not None
        scope: Any = None
        try:
            with cancel_after(self.job.max_runtime) as scope:
                self.running.stoppable(scope.cancel)
                yield
        except CancelledError:
            if scope is None or not scope.cancelled():
                raise
            if self.running.stopped is not None:
                raise StopAsked(self.running.stopped) from None
            raise PastMaxRuntime(f"past max_runtime {fmt_duration(self.job.max_runtime)}") from None
        finally:
            self.running.over()

    def ended(self, error: BaseException | None = None) -> dict[str, Any] | None:
        """Settle once, now, as the body's ending names it (`Running.ended`); its GPUs are
        given back with the settlement."""
        return self.running.ended(error) if self.running is not None else None

    def _release_gpus(self) -> None:
        release_gpus(self.gpus)

    def stopped(self, error: PastMaxRuntime | StopAsked) -> State | None:
        """Settle a body a stop ended; the state its task run ends in (`stopped_state`), or
        None when it is to be queued again (preempted, `requeue`)."""
        row = self.ended(error)
        assert row is not None and self.running is not None
        if not self.running.requeue:
            return stopped_state(self.running, row)
        _log_requeue(self.running.stop_message(row))
        return None


def _log_requeue(message: str) -> None:
    with contextlib.suppress(Exception):  # outside a run there is nothing to log to
        get_run_logger().warning("GPU task %s; queued again", message)


@contextmanager
def _as_current(run: _GatedRun) -> Iterator[None]:
    token = _current.set(run.current())
    try:
        yield
    finally:
        _current.reset(token)


def _settings_of_run(defaults: Mapping[str, Any], gpu: Mapping[str, Any] | None) -> dict:
    ctx = TaskRunContext.get()
    task = ctx.task if ctx else None
    base = getattr(task, "gpu_settings", defaults)
    return {**base, **_settings(gpu, "gpu")}


def _task_name() -> str:
    ctx = TaskRunContext.get()
    return ctx.task.name if ctx else "gpu-task"


def _gated(fn: Callable[..., Any], defaults: Mapping[str, Any]) -> Callable[..., Any]:
    """`fn` behind the gate, with a keyword-only `gpu` for one call's settings."""
    signature = inspect.signature(fn)
    if "gpu" in signature.parameters:
        raise TypeError(f"{fn.__name__} has a parameter 'gpu', which @gpu_task keeps for settings")
    gated = _gated_async if inspect.iscoroutinefunction(fn) else _gated_sync
    wrapper = gated(fn, defaults)
    params = list(signature.parameters.values())
    extra = inspect.Parameter("gpu", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    wrapper.__signature__ = signature.replace(parameters=[*params[:at], extra, *params[at:]])  # type: ignore[attr-defined]
    return wrapper


def _gated_async(fn: Callable[..., Any], defaults: Mapping[str, Any]) -> Callable[..., Any]:
    """An async `fn` admitted, run and settled, once unless a preemption queues it again."""

    @functools.wraps(fn)
    async def run_async(*args: Any, gpu: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        run = _GatedRun(_settings_of_run(defaults, gpu), _task_name())
        while True:  # once, unless a preemption queues it again
            refused = await asyncio.to_thread(run.admit)
            if refused is not None:
                return refused
            try:
                with run.stoppable(cancel_async_after), _as_current(run):
                    result = await fn(*args, **kwargs)
            except (PastMaxRuntime, StopAsked) as stopped:
                state = await asyncio.to_thread(run.stopped, stopped)
                if state is None:
                    continue
                return state
            except Exception as error:
                await asyncio.to_thread(run.ended, error)
                raise
            except BaseException as cancelled:
                run.ended(cancelled)  # in this thread: an await in a cancelled task may not end
                raise
            await asyncio.to_thread(run.ended)
            return result

    return run_async


def _gated_sync(fn: Callable[..., Any], defaults: Mapping[str, Any]) -> Callable[..., Any]:
    """A plain `fn` admitted, run and settled, once unless a preemption queues it again."""

    @functools.wraps(fn)
    def run_sync(*args: Any, gpu: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        run = _GatedRun(_settings_of_run(defaults, gpu), _task_name())
        while True:  # once, unless a preemption queues it again
            refused = run.admit()
            if refused is not None:
                return refused
            try:
                with run.stoppable(cancel_sync_after), _as_current(run):
                    result = fn(*args, **kwargs)
            except (PastMaxRuntime, StopAsked) as stopped:
                state = run.stopped(stopped)
                if state is None:
                    continue
                return state
            except BaseException as exc:
                run.ended(exc)
                raise
            run.ended()
            return result

    return run_sync


def _no_retry_when_refused(user: Callable[..., Any] | None) -> Callable[..., Any]:
    """A refusal by the budget and a stop are final (`FINAL_STATES`); other failures retry as
    the user's condition says."""

    def condition(task: Task, task_run: Any, state: State) -> Any:
        if state.name in FINAL_STATES:
            return False
        return True if user is None else user(task, task_run, state)

    return condition


class GpuTask(Task):
    """A Prefect task whose runs pass the gate (see `gpu_task`). `gpu_settings` are its
    defaults; `.with_options(gpu={...})` gives a copy with some changed."""

    gpu_settings: dict[str, Any]

    def with_options(self, *, gpu: Mapping[str, Any] | None = None, **options: Any) -> GpuTask:
        if "retry_condition_fn" in options:
            options["retry_condition_fn"] = _no_retry_when_refused(options["retry_condition_fn"])
        return _as_gpu_task(
            super().with_options(**options), {**self.gpu_settings, **_settings(gpu, "gpu")}
        )


def _as_gpu_task(task: Task, settings: dict[str, Any]) -> GpuTask:
    task.__class__ = GpuTask  # the same object, with `with_options` keeping the settings
    task.gpu_settings = settings  # type: ignore[attr-defined]
    return task  # type: ignore[return-value]


def gpu_task(
    fn: Callable[..., Any] | None = None, /, **settings: Any
) -> GpuTask | Callable[[Callable[..., Any]], GpuTask]:
    """Make `fn` a Prefect task whose every run passes the gate (see the module's docstring).

    Keyword arguments that are `GpuJob` fields, `scope` or `ledger` are the job's settings;
    the rest (`name`, `retries`, `tags`, ...) go to Prefect's `@task`.
    """
    if fn is None:
        return lambda f: gpu_task(f, **settings)  # type: ignore[return-value]
    job = {k: v for k, v in settings.items() if k in SETTINGS and k != "name"}
    options = {k: v for k, v in settings.items() if k not in job}
    options.setdefault("cache_policy", NO_CACHE)  # a cached result would skip the gate
    options["retry_condition_fn"] = _no_retry_when_refused(options.get("retry_condition_fn"))
    if "scope" in job:
        validate_scope(job["scope"])
    fields = {k: v for k, v in job.items() if k not in ("scope", "ledger")}
    if "instance_type" in fields and "max_runtime" in fields:
        GpuJob(**fields)  # a mistake in the settings shows here, not at the first run
    return _as_gpu_task(Task(fn=_gated(fn, job), **options), job)
