"""`GpuJob`: the shape of one GPU workload, validated before anything is reserved."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from prefect_gpu_budget.priorities import HIGHEST, LOWEST, NAME_RE, priority_classes
from prefect_gpu_budget.units import BudgetInputError, parse_duration, shown

if TYPE_CHECKING:
    from prefect_gpu_budget.pricing.catalog import PriceRow, Quote


def _runtime(value: object) -> float:
    return parse_duration(value, "duration")


def _wait(value: object) -> float | None:
    return None if value is None else parse_duration(value, "max_wait", allow_zero=True)


def _priority(value: object) -> int | str:
    """An integer in -1000..1000, or a class: built-in and environment classes resolve here;
    another well-formed name is an org's own class, resolved when the job is recorded."""
    classes = priority_classes()
    if isinstance(value, str) and value in classes:
        return classes[value]
    if isinstance(value, int) and not isinstance(value, bool) and LOWEST <= value <= HIGHEST:
        return value
    if isinstance(value, str) and NAME_RE.fullmatch(value):
        return value
    names = ", ".join(sorted(classes, key=lambda n: -classes[n]))
    raise BudgetInputError(
        "priority",
        f"must be one of {names}, an org's own class, or an integer in -1000..1000, "
        f"got {shown(value)}",
    )


Duration = Annotated[float, BeforeValidator(_runtime)]


@dataclass(frozen=True)
class NodeShare:
    """What each node of a job takes of its machine, and the part of the machine's price it
    pays: all of it for a whole machine; for a part (`gpus`, `vcpu`, `memory_gib`), the largest
    of the parts it asks, as a dominant-resource share."""

    gpus: int
    vcpu: int
    """0: the pool's proportional default (k of G GPUs bring k/G of the vCPU)."""
    memory_gib: int
    """0: the pool's proportional default."""
    fraction: Fraction
    whole: bool = False
    """A whole machine per node; a part runs only on a capacity pool's machines."""

    def price(self, rate_micro_per_hour: int) -> int:
        """The job's rate: its part of the machines' rate, rounded up to a micro-dollar."""
        return math.ceil(rate_micro_per_hour * self.fraction)


FLEX_START_MAX_RUNTIME_S = 7 * 86400
"""The longest a flex-start job runs: Dynamic Workload Scheduler's limit."""


def check_flex_start_runtime(provisioning: str, max_runtime: float) -> None:
    """A flex-start job past DWS's 7 days: a one-line `BudgetInputError`."""
    if provisioning == "flex-start" and max_runtime > FLEX_START_MAX_RUNTIME_S:
        raise BudgetInputError(
            "max_runtime",
            "a flex-start job runs at most 7 days (Dynamic Workload Scheduler), got "
            f"{max_runtime:g}s",
        )


class GpuJob(BaseModel):
    """One GPU job: what runs, on what, for at most how long.

    `max_runtime` is required: it bounds the reservation (guaranteed mode holds rate x
    max_runtime) and the launcher stops the job when it runs out.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_type: str = Field(
        "",
        description="`cloud:type`, e.g. `aws:g5.xlarge` or `local:workstation`; left out when "
        "the job asks for `accelerators` instead (the gate's placement fills it in).",
    )
    accelerators: str | None = Field(
        None,
        description="Accelerators instead of a machine, in SkyPilot's spelling: `H100:8` (a "
        "model and a count per node) or `{H100:8, H200:8}` (any of these): the job is placed on "
        "the cheapest offering of the saved launchers and pools that fits its budgets, its max "
        "wait and its deadline.",
    )
    deadline: Duration | None = Field(
        None,
        description="With `accelerators`: the latest acceptable end, from when it is asked "
        "(seconds, or a duration like '12h').",
    )
    checkpoint: str | None = Field(
        None,
        description="Where the job saves its checkpoint: a job that asks for `accelerators` and "
        "has one is placed again when its machine is taken back, and resumes from it.",
    )
    max_placements: int = Field(
        3, ge=1, le=20, description="With `accelerators` and a `checkpoint`: the most places."
    )
    max_runtime: Duration = Field(description="Seconds, or a duration like '2h' or '1h30m'.")
    nodes: int = Field(1, ge=1, le=1024, description="Machines started together.")
    provisioning: Literal["on-demand", "spot", "flex-start"] = "on-demand"
    expected_runtime: Duration | None = Field(None, description="Used by estimate mode.")
    priority: Annotated[int | str, BeforeValidator(_priority)] = Field(
        0, description="An integer in -1000..1000 or a priority class (see `priorities`)."
    )
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
    gpus: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="GPUs of each machine the job takes (default: all). With `vcpu` and "
        "`memory_gib`, a part of a capacity pool's machine, priced in proportion.",
    )
    vcpu: int | None = Field(
        None, ge=0, le=100_000, description="vCPU of each machine (default: in proportion)."
    )
    memory_gib: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="Memory of each machine, GiB (default: in proportion).",
    )
    grant: str | None = Field(
        None,
        description="The agent grant (its id, never the token) this job spends under: set by "
        "the agent sweep; the job queues only while the grant is live.",
    )

    @model_validator(mode="after")
    def _check(self) -> GpuJob:
        """Checks across fields, each a one-line `BudgetInputError` (a flex-start job past
        DWS's 7 days is refused here, before any runner or price sees it)."""
        if self.expected_runtime is not None and self.expected_runtime > self.max_runtime:
            raise BudgetInputError("expected_runtime", "must not exceed max_runtime")
        if self.command is not None and not self.command:
            raise BudgetInputError("command", "must not be empty")
        check_flex_start_runtime(self.provisioning, self.max_runtime)
        if self.accelerators is not None:
            return self._check_asked_for_accelerators()
        if self.deadline is not None:
            raise BudgetInputError("deadline", "is for a job that asks for accelerators")
        if ":" not in self.instance_type:
            raise BudgetInputError(
                "instance_type",
                f"must be 'cloud:type' like 'aws:g5.xlarge', got {shown(self.instance_type)}",
            )
        return self

    def _check_asked_for_accelerators(self) -> GpuJob:
        """A machine named beside accelerators is the placement's, and must be `cloud:type` too.
        The spelling itself is read where the job is placed (`placement.accelerators`), which
        sits above this module."""
        if self.instance_type and ":" not in self.instance_type:
            raise BudgetInputError(
                "instance_type",
                f"must be 'cloud:type' like 'aws:g5.xlarge', got {shown(self.instance_type)}",
            )
        if self.deadline is not None and self.deadline < self.max_runtime:
            raise BudgetInputError(
                "deadline", "is before the job could end: it must be at least max_runtime"
            )
        return self

    _choice: str | None = PrivateAttr(default=None)

    @property
    def placed(self) -> bool:
        """It names its machine: asked so, or placed by the gate."""
        return bool(self.instance_type)

    @property
    def choice(self) -> str | None:
        """How the gate placed it (JSON: what it asked and every offering considered, chosen or
        why passed over), recorded on its ledger row; None for a job that named its machine."""
        return self._choice

    def placed_as(self, choice: str) -> GpuJob:
        """This job, placed, carrying the placement's `choice` to its ledger row."""
        placed = self.model_copy()
        placed._choice = choice
        return placed

    def priced(self, quote: Quote) -> tuple[Quote, NodeShare]:
        """The job's quote, from its machines' (`quote`): their price, or its part of it; and
        what each node takes of a machine."""
        share = self.share_of(quote.row)
        if share.fraction == 1:
            return quote, share
        return replace(quote, rate_micro_per_hour=share.price(quote.rate_micro_per_hour)), share

    def share_of(self, row: PriceRow) -> NodeShare:
        """What each node takes of a machine of `row`'s shape: the whole machine unless the job
        asks for less (`gpus`, `vcpu`, `memory_gib`); a part that asks more than the machine
        has, or that cannot be priced, is a one-line `BudgetInputError`."""
        whole = NodeShare(row.gpus, row.vcpu, row.memory_gib, Fraction(1), whole=True)
        if self.gpus is None and self.vcpu is None and self.memory_gib is None:
            return whole
        asked = {"gpus": self.gpus, "vcpu": self.vcpu, "memory_gib": self.memory_gib}
        has = {"gpus": row.gpus, "vcpu": row.vcpu, "memory_gib": row.memory_gib}
        unit = {"gpus": "GPUs", "vcpu": "vCPU", "memory_gib": "GiB"}
        parts = []
        for field, value in asked.items():
            if value is None:
                continue
            if not has[field]:
                if value and field == "gpus":
                    raise BudgetInputError(field, f"{row.key} has no GPUs")
                if value:
                    raise BudgetInputError(
                        field,
                        f"the price of {row.key} records no {unit[field]} per machine, so a "
                        "part of it cannot be priced; ask for gpus, or record the machine's "
                        "shape (`prices set-local --vcpu --memory-gib`)",
                    )
                continue
            if value > has[field]:
                raise BudgetInputError(
                    field, f"asks {value} {unit[field]}, but {row.key} has {has[field]}"
                )
            parts.append(Fraction(value, has[field]))
        if not any(parts):
            raise BudgetInputError(
                "gpus", "a part of a machine must ask for some GPUs, vCPU or memory"
            )
        if max(parts) == 1 and self.gpus in (None, row.gpus):
            return whole  # all of a machine, asked field by field
        return NodeShare(self.gpus or 0, self.vcpu or 0, self.memory_gib or 0, max(parts))

    @property
    def reserve_runtime_s(self) -> float:
        """The longest the job can be billed for: max_runtime plus the launcher's kill grace."""
        return self.max_runtime + self.kill_grace

    def stopped_run_s(self, ran_s: float) -> float:
        """What a run stopped at max_runtime is billed for: at most `reserve_runtime_s`, the
        bound its reservation holds. It was killed by then; the moments the kill takes to land
        and to be seen are the runner's, not the job's."""
        return min(ran_s, self.reserve_runtime_s)


class LaunchConfigError(ValueError):
    """A launcher setting is wrong for the job; raised by a launcher's `preflight` (or by the
    sandbox an agent's local job runs in), before anything is reserved."""

    def __init__(self, launcher: str, reason: str) -> None:
        self.launcher = launcher
        self.reason = reason
        super().__init__(f"{launcher} launcher: {reason}")


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
