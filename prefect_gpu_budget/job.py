"""`GpuJob`: the shape of one GPU workload, validated before anything is reserved."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from prefect_gpu_budget.settings import METRICS_ENV as METRICS_ENV
from prefect_gpu_budget.units import BudgetInputError, parse_duration, shown

PRIORITY_CLASSES = {"high": 100, "normal": 0, "low": -100}
PRIORITY_CLASSES_ENV = "PREFECT_GPU_BUDGET_PRIORITY_CLASSES"
"""More named classes, e.g. `urgent=500,scavenger=-500` (values in -1000..1000)."""


def _runtime(value: object) -> float:
    return parse_duration(value, "duration")


def _wait(value: object) -> float | None:
    return None if value is None else parse_duration(value, "max_wait", allow_zero=True)


def priority_classes() -> dict[str, int]:
    """The named priority classes: high, normal, low, plus those the environment defines."""
    return {**PRIORITY_CLASSES, **_parse_classes(os.environ.get(PRIORITY_CLASSES_ENV, ""))}


@lru_cache(maxsize=8)
def _parse_classes(text: str) -> dict[str, int]:
    found = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            number = int(value)
        except ValueError:
            number = None
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", name) or number is None:
            raise BudgetInputError(
                PRIORITY_CLASSES_ENV, f"expected name=integer, got {shown(item)}"
            )
        if not -1000 <= number <= 1000:
            raise BudgetInputError(PRIORITY_CLASSES_ENV, f"{name}: must be in -1000..1000")
        found[name] = number
    return found


def _priority(value: object) -> int:
    classes = priority_classes()
    if isinstance(value, str) and value in classes:
        return classes[value]
    if isinstance(value, int) and not isinstance(value, bool) and -1000 <= value <= 1000:
        return value
    names = ", ".join(sorted(classes, key=lambda n: -classes[n]))
    raise BudgetInputError(
        "priority", f"must be one of {names} or an integer in -1000..1000, got {shown(value)}"
    )


Duration = Annotated[float, BeforeValidator(_runtime)]


class GpuJob(BaseModel):
    """One GPU job: what runs, on what, for at most how long.

    `max_runtime` is required: it bounds the reservation (guaranteed mode holds rate x
    max_runtime) and the launcher stops the job when it runs out.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_type: str = Field(
        description="`cloud:type`, e.g. `aws:g5.xlarge` or `local:workstation`."
    )
    max_runtime: Duration = Field(description="Seconds, or a duration like '2h' or '1h30m'.")
    nodes: int = Field(1, ge=1, le=1024, description="Machines started together.")
    provisioning: Literal["on-demand", "spot", "flex-start"] = "on-demand"
    expected_runtime: Duration | None = Field(None, description="Used by estimate mode.")
    priority: Annotated[int, BeforeValidator(_priority)] = 0
    command: list[str] | None = Field(None, description="What the local launcher runs.")
    env: dict[str, str] = Field(default_factory=dict)
    name: str | None = Field(None, max_length=200)
    on_limit: Literal["queue", "reject"] | None = None
    max_wait: Annotated[float | None, BeforeValidator(_wait)] = None
    kill_grace: Annotated[float, BeforeValidator(lambda v: parse_duration(v, "kill_grace"))] = 10.0
    pool: str | None = Field(
        None, description="The capacity pool to run in; default: the pool serving its type."
    )
    requeue: bool = Field(True, description="Queue again after being preempted.")
    grant: str | None = Field(
        None,
        description="The agent grant (its id, never the token) this job spends under: set by "
        "the agent sweep; the job queues only while the grant is live.",
    )

    @model_validator(mode="after")
    def _check(self) -> GpuJob:
        if self.expected_runtime is not None and self.expected_runtime > self.max_runtime:
            raise BudgetInputError("expected_runtime", "must not exceed max_runtime")
        if self.command is not None and not self.command:
            raise BudgetInputError("command", "must not be empty")
        if ":" not in self.instance_type:
            raise BudgetInputError(
                "instance_type",
                f"must be 'cloud:type' like 'aws:g5.xlarge', got {shown(self.instance_type)}",
            )
        return self

    @property
    def reserve_runtime_s(self) -> float:
        """The longest the job can be billed for: max_runtime plus the launcher's kill grace."""
        return self.max_runtime + self.kill_grace


def one_line(exc: BaseException) -> str:
    """A user-facing one-line message, naming the field, for validation and input errors."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, BudgetInputError):
            inner = ctx_error.field
            if not field or inner == field.split(".")[-1]:
                return str(ctx_error) if not field else f"{field}: {ctx_error.rule}"
            where = field if inner == "duration" else f"{field}.{inner}"
            return f"{where}: {ctx_error.rule}"
        field = field or exc.title
        return f"{field}: {err['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
