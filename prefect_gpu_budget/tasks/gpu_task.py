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

The body runs in the task's own process: `max_runtime` stops it by raising in its thread, so a
body blocked in C code stops when it returns to Python. A body is not preempted (borrowed
capacity it holds is given back when it ends); a job whose body must be preemptible runs as a
command through `run_gpu_job`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.states import Failed, State
from prefect.utilities.timeout import timeout, timeout_async

from prefect_gpu_budget.admission.gate import Admission, AdmissionRefused
from prefect_gpu_budget.admission.lifecycle import FAILED, PastMaxRuntime, Settlement
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import _grant, _release, visible_gpus
from prefect_gpu_budget.tasks.defaults import current_defaults
from prefect_gpu_budget.tasks.gpu_job import _flow_run_id, gate_for_run
from prefect_gpu_budget.units import BudgetInputError, fmt_duration, fmt_usd, validate_scope

REFUSED_STATES = frozenset({"OverBudget", "AdmissionTimeout", "GateRefused"})
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
    """One run of a `@gpu_task`: admit, give it GPUs, settle once."""

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
        self.settlement: Settlement | None = None
        self.gpus: list[int] = []
        self.started_at = 0.0
        if not self.refusal:  # a refused run opens no ledger
            self.gate = gate_for_run(self.scope, self.job, self.ledger)

    def admit(self) -> State | None:
        """Wait for admission; the refusal's state if refused. Then the job starts now."""
        if self.refusal:  # settings its flow does not allow: nothing is reserved
            return Failed(name="GateRefused", message=self.refusal)
        try:
            self.admission = self.gate.admit(
                self.job, self.scope, flow_run_id=_flow_run_id(), launcher="task"
            )
        except AdmissionRefused as refused:
            return Failed(name=refused.state_name, message=refused.reason)
        self.settlement = Settlement(self.gate, self.admission, then=self._release_gpus)
        share = self.job.share_of(self.admission.quote.row)
        wanted = share.gpus * self.job.nodes
        self.gpus = _grant(wanted)
        self.started_at = time.time()
        if len(self.gpus) < wanted and visible_gpus():
            self.settlement.settle(FAILED)
            return Failed(name="GpuJobFailed", message=f"fewer than {wanted} GPUs free here")
        ctx = TaskRunContext.get()
        run_id = str(ctx.task_run.id) if ctx else self.admission.job_id
        self.gate.started(self.admission, self.started_at, f"task:{run_id}")
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

    def ended(self, error: BaseException | None = None) -> None:
        """Settle once, now, as the body's ending names it (`lifecycle.outcome_of`); its GPUs
        are given back with the settlement."""
        if self.settlement is not None:
            self.settlement.ended(error)

    def _release_gpus(self) -> None:
        _release(self.gpus)

    def timed_out(self) -> State:
        row = self.settlement.row if self.settlement is not None else None
        cost = fmt_usd((row or {}).get("actual_micro") or 0)
        return Failed(
            name="TimedOut",
            message=f"stopped at max_runtime {fmt_duration(self.job.max_runtime)}; cost {cost}",
        )


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
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, gpu: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
            run = _GatedRun(_settings_of_run(defaults, gpu), _task_name())
            refused = await asyncio.to_thread(run.admit)
            if refused is not None:
                return refused
            try:
                limit = run.job.max_runtime
                with timeout_async(limit, timeout_exc_type=PastMaxRuntime), _as_current(run):
                    result = await fn(*args, **kwargs)
            except PastMaxRuntime as stopped:
                await asyncio.to_thread(run.ended, stopped)
                return run.timed_out()
            except Exception as error:
                await asyncio.to_thread(run.ended, error)
                raise
            except BaseException as cancelled:
                run.ended(cancelled)  # in this thread: an await in a cancelled task may not end
                raise
            await asyncio.to_thread(run.ended)
            return result

        wrapper: Callable[..., Any] = run_async
    else:

        @functools.wraps(fn)
        def run_sync(*args: Any, gpu: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
            run = _GatedRun(_settings_of_run(defaults, gpu), _task_name())
            refused = run.admit()
            if refused is not None:
                return refused
            try:
                limit = run.job.max_runtime
                with timeout(limit, timeout_exc_type=PastMaxRuntime), _as_current(run):
                    result = fn(*args, **kwargs)
            except PastMaxRuntime as stopped:
                run.ended(stopped)
                return run.timed_out()
            except BaseException as exc:
                run.ended(exc)
                raise
            run.ended()
            return result

        wrapper = run_sync
    signature = inspect.signature(fn)
    if "gpu" in signature.parameters:
        raise TypeError(f"{fn.__name__} has a parameter 'gpu', which @gpu_task keeps for settings")
    params = list(signature.parameters.values())
    extra = inspect.Parameter("gpu", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    wrapper.__signature__ = signature.replace(parameters=[*params[:at], extra, *params[at:]])  # type: ignore[attr-defined]
    return wrapper


def _no_retry_when_refused(user: Callable[..., Any] | None) -> Callable[..., Any]:
    """A refusal by the budget is final; other failures retry as the user's condition says."""

    def condition(task: Task, task_run: Any, state: State) -> Any:
        if state.name in REFUSED_STATES:
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
