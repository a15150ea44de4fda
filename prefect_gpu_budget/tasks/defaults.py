"""`job_defaults`: the GPU-job settings a flow gives the `@gpu_task` runs inside it.

```python
@flow
def search(session: str):
    with job_defaults(scope=session, instance_type="gcp:a2-highgpu-1g", max_runtime="2h"):
        return [f.result() for f in train.map([1e-3, 3e-3])]
```

The sweep flows set it around their trials (the spec's scope, its job shape and ledger, and for
an agent's sweep the agent's grant). A `@gpu_task` run reads it for what it is not given
itself: a call's `gpu={...}` wins over `.with_options(gpu=...)`, which wins over the
decorator, which wins over the flow's defaults. Three settings are the flow's to bound, not
defaults, so that nothing inside a flow spends beyond what the flow was given:

- `scope`: a task may narrow it (a sub-scope) but never move elsewhere;
- `ledger`: a task may not point the gate at another ledger;
- `grant`: an agent's grant is the flow's alone and applies to every job inside.

A task whose settings break one of these ends `GateRefused` with a one-line reason, and
nothing is reserved. Contexts nest: an inner `job_defaults` may narrow the outer's scope and
change its other defaults, but not widen, move the ledger or change the grant (a one-line
`BudgetInputError` at the `with`). The defaults reach tasks run in threads of the flow's
process (Prefect copies the context into them), not tasks sent to other processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.units import BudgetInputError, narrowing_refusal, validate_scope

if TYPE_CHECKING:
    from prefect_gpu_budget.blocks.ledger import SpendLedger

JOB_FIELDS = frozenset(GpuJob.model_fields) - {"command", "env", "grant", "name"}
"""The `GpuJob` fields a flow's defaults may carry."""


@dataclass(frozen=True)
class JobDefaults:
    """What the enclosing flow gives its GPU jobs (see the module's docstring)."""

    scope: str | None = None
    ledger: SpendLedger | None = None
    grant: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def inner(self, given: JobDefaults) -> JobDefaults:
        """`given` nested inside these defaults; a one-line `BudgetInputError` if it widens."""
        if given.scope is not None:
            why = narrowing_refusal(given.scope, self.scope, "the enclosing defaults'")
            if why:
                raise BudgetInputError("scope", why)
        if why := _ledger_refusal(given.ledger, self.ledger):
            raise BudgetInputError("ledger", why)
        if given.grant is not None and self.grant is not None and given.grant != self.grant:
            raise BudgetInputError("grant", "the enclosing flow's agent grant cannot change")
        return JobDefaults(
            scope=given.scope or self.scope,
            ledger=given.ledger or self.ledger,
            grant=given.grant or self.grant,
            fields={**self.fields, **given.fields},
        )

    def apply(self, settings: Mapping[str, Any]) -> tuple[dict[str, Any], str | None, str]:
        """A task run's settings (decorator, options and call merged) over these defaults:
        (the settings, the grant, why they may not be used or "")."""
        out = {**self.fields, **settings}
        scope = settings.get("scope")
        if scope is not None and self.scope is not None:
            why = narrowing_refusal(str(scope), self.scope, "its flow's")
            if why:
                return out, self.grant, why
        out["scope"] = scope or self.scope
        if why := _ledger_refusal(settings.get("ledger"), self.ledger):
            return out, self.grant, why
        out["ledger"] = settings.get("ledger") or self.ledger
        return out, self.grant, ""


def _ledger_refusal(ledger: SpendLedger | None, outer: SpendLedger | None) -> str:
    if ledger is None or outer is None or ledger.url() == outer.url():
        return ""
    return "ledger: a task may not use another ledger than its flow's"


_NONE = JobDefaults()
_defaults: ContextVar[JobDefaults | None] = ContextVar("gpu_budget_job_defaults", default=None)


def current_defaults() -> JobDefaults:
    """The job defaults in force here (empty outside any `job_defaults`)."""
    return _defaults.get() or _NONE


@contextmanager
def job_defaults(
    *,
    scope: str | None = None,
    ledger: SpendLedger | None = None,
    grant: str | None = None,
    **fields: Any,
) -> Iterator[JobDefaults]:
    """Give the `@gpu_task` runs inside this block these settings where they set none
    themselves; `scope`, `ledger` and `grant` bound them (see the module's docstring)."""
    unknown = sorted(set(fields) - JOB_FIELDS)
    if unknown:
        raise BudgetInputError(
            unknown[0], "unknown job default; known: scope, ledger, grant, and GpuJob's fields"
        )
    given = JobDefaults(
        scope=None if scope is None else validate_scope(scope),
        ledger=ledger,
        grant=grant,
        fields=dict(fields),
    )
    merged = current_defaults().inner(given)
    token = _defaults.set(merged)
    try:
        yield merged
    finally:
        _defaults.reset(token)
