"""The validated shapes of what an admin sets: a scope's budget, a capacity pool and a team's
share of it.

They are free of Prefect, so that the CLI's ledger commands stay fast; the blocks in `blocks/`
are these models plus Prefect's `Block` (saving, loading, the UI's forms).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from prefect_gpu_budget.admission.ledger.grants import Grants
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.units import (
    AGENT_MAX_QUEUED,
    MAX_CAP_CENTS,
    MAX_CAP_RULE,
    MICRO_PER_USD,
    BudgetInputError,
    cap_cents,
    parse_duration,
    shown,
    to_decimal_usd,
    usd_to_micro,
    validate_scope,
)

Scope = Annotated[str, BeforeValidator(lambda v: validate_scope(v))]
"""A scope path (`org`, `org/team` or `org/team/session`), validated as pydantic reads it."""


def _usd(field: str):  # noqa: ANN202 - a pydantic validator factory
    return BeforeValidator(lambda v: None if v is None else to_decimal_usd(v, field))


class BudgetSettings(BaseModel):
    """Spend bounds for a scope (`org`, `org/team` or `org/team/session`).

    A job must fit every budget on its scope's path at once: the hourly cap (its rate plus the
    rates of the scope's running jobs) and the period budget (settled plus reserved spend plus
    its own reservation, in the calendar period).
    """

    scope: Scope = Field(description="The scope this budget bounds, e.g. 'acme/vision/agent-7'.")
    hourly_cap_usd: Annotated[Decimal | None, _usd("hourly_cap_usd")] = Field(
        default=None, description="Most the scope's running jobs may cost per hour, in USD."
    )
    period_budget_usd: Annotated[Decimal | None, _usd("period_budget_usd")] = Field(
        default=None, description="Most the scope may spend in one calendar period, in USD."
    )
    period: Literal["day", "week", "month"] = Field(
        default="month", description="The calendar period of the budget."
    )
    timezone: str = Field(default="UTC", description="Time zone in which periods begin.")
    on_limit: Literal["queue", "reject"] = Field(
        default="queue", description="What a job that does not fit does: wait, or end at once."
    )
    max_wait: Annotated[
        float, BeforeValidator(lambda v: parse_duration(v, "max_wait", allow_zero=True))
    ] = Field(
        default=86400.0,
        description="Longest a queued job waits, in seconds or like '6h'; 0 waits forever.",
    )
    reservation_mode: Literal["guaranteed", "estimate"] = Field(
        default="guaranteed",
        description="Hold rate x max_runtime (guaranteed) or rate x expected_runtime (estimate).",
    )
    notify_block: str | None = Field(
        default=None,
        description="Notification block to tell when a job starts waiting, as 'type-slug/name'.",
    )

    @field_validator("hourly_cap_usd")
    @classmethod
    def _cap(cls, value: Decimal | None) -> Decimal | None:
        if value is not None and cap_cents(usd_to_micro(value)) > MAX_CAP_CENTS:
            raise BudgetInputError("hourly_cap_usd", MAX_CAP_RULE)
        return value

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        periods.zone(value)
        return value

    @field_validator("notify_block")
    @classmethod
    def _notify(cls, value: str | None) -> str | None:
        if value is not None and (value.count("/") != 1 or not all(value.split("/"))):
            raise ValueError(f"must be 'block-type-slug/block-name', got {shown(value)}")
        return value

    def rule(self) -> BudgetRule:
        """The budget in the ledger's exact units."""
        return BudgetRule(
            scope=self.scope,
            hourly_cap_cents=None
            if self.hourly_cap_usd is None
            else cap_cents(usd_to_micro(self.hourly_cap_usd)),
            period_budget_micro=None
            if self.period_budget_usd is None
            else usd_to_micro(self.period_budget_usd),
            period=self.period,
            timezone=self.timezone,
            on_limit=self.on_limit,
            max_wait_s=self.max_wait,
            reservation_mode=self.reservation_mode,
            notify_block=self.notify_block,
        )

    @classmethod
    def fields_of(cls, rule: BudgetRule) -> dict[str, object]:
        """The block fields of a ledger budget (the reverse of `rule`)."""
        return {
            "scope": rule.scope,
            "hourly_cap_usd": None
            if rule.hourly_cap_cents is None
            else Decimal(rule.hourly_cap_cents) / 100,
            "period_budget_usd": None
            if rule.period_budget_micro is None
            else Decimal(rule.period_budget_micro) / MICRO_PER_USD,
            "period": rule.period,
            "timezone": rule.timezone,
            "on_limit": rule.on_limit,
            "max_wait": rule.max_wait_s,
            "reservation_mode": rule.reservation_mode,
            "notify_block": rule.notify_block,
        }


class TeamShare(BaseModel):
    """A team's quota in a pool. Giving only `gpus` sets vCPU and memory in proportion."""

    model_config = ConfigDict(extra="forbid")

    team: Scope = Field(description="'org/team'.")
    gpus: int = Field(ge=0, le=100_000, description="Accelerators guaranteed to the team.")
    vcpu: int | None = Field(None, ge=0, description="Default: in proportion to `gpus`.")
    memory_gib: int | None = Field(None, ge=0, description="Default: in proportion to `gpus`.")
    borrow_pct: int = Field(
        50, ge=0, le=1000, description="May borrow this % of its quota more (HyperPod's default)."
    )
    lend_pct: int = Field(100, ge=0, le=100, description="% of its idle quota others may borrow.")
    weight: int = Field(50, ge=0, le=100, description="Fair share of idle capacity (0 = last).")
    reclaim: Literal["any", "lower_priority", "never"] = Field(
        "any", description="Which borrowers of its lent quota the team's jobs may preempt."
    )
    within_team: Literal["lower_priority", "never"] = Field(
        "lower_priority", description="Whether its jobs preempt its own lower-priority work."
    )
    queueing: Literal["best_effort_fifo", "strict_fifo"] = Field(
        "best_effort_fifo", description="Whether a blocked job holds the team's later jobs."
    )


class PoolSettings(BaseModel):
    """Machines (an on-prem inventory: `nodes` of one shape) or a cloud quota (totals only)
    that jobs of some instance types run on, and the teams' quotas of it.

    A job is admitted only when all its nodes fit at once, its team's quota (plus what it may
    borrow of idle capacity) allows it, and every budget on its path does.
    """

    org: Scope = Field(description="The org whose jobs use this pool.")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,47}$", description="e.g. 'lab-a'.")
    nodes: int = Field(ge=1, le=100_000, description="Machines (or quota units) in the pool.")
    gpus_per_node: int = Field(ge=0, le=64, description="Accelerators in each machine.")
    vcpu_per_node: int = Field(0, ge=0, le=100_000, description="vCPU in each machine.")
    memory_gib_per_node: int = Field(
        0, ge=0, le=10_000_000, description="Memory of each machine, GiB."
    )
    gpu_model: str = Field("", max_length=64, description="Shown in reasons, e.g. 'H100'.")
    instance_types: list[str] = Field(
        default_factory=list, description="Jobs on these instance types run here."
    )
    kind: Literal["inventory", "quota"] = Field(
        "inventory", description="inventory: each job node on its own machine; quota: totals."
    )
    backfill: bool = Field(False, description="Let small jobs pass a blocked big one.")
    teams: list[TeamShare] = Field(
        default_factory=list, description="Each team's quota, borrow and lend limits, weight."
    )

    def pool(self) -> Pool:
        return Pool(
            org=self.org,
            name=self.name,
            nodes=self.nodes,
            node=(self.gpus_per_node, self.vcpu_per_node, self.memory_gib_per_node),
            instance_types=tuple(self.instance_types),
            gpu_model=self.gpu_model,
            kind=self.kind,
            backfill=self.backfill,
        )

    def quotas(self) -> list[TeamQuota]:
        pool = self.pool()
        return [
            TeamQuota(
                pool=self.name,
                team=t.team,
                quota=proportional(pool, t.gpus, t.vcpu, t.memory_gib),
                borrow_pct=t.borrow_pct,
                lend_pct=t.lend_pct,
                weight=t.weight,
                reclaim=t.reclaim,
                within_team=t.within_team,
                queueing=t.queueing,
            )
            for t in self.teams
        ]


DEPLOYMENT_REFUSED = (
    "a deployment launcher is not for agents: its job runs in the target flow run as the "
    "target worker, with that worker's Prefect credentials, ledger URL and cloud keys, and "
    "can write its own run's state (its billing); grant agents 'local' (sandboxed) or a "
    "vertex:/sagemaker: block"
)
"""Why `agent limits --launcher deployment:...` is refused (the agents' door stays shut)."""


class AgentLimits(BaseModel):
    """An admin's ceilings on what the agents of a team's sessions may ask for (set per team,
    beside its session template; without it these defaults apply)."""

    model_config = ConfigDict(extra="forbid")

    team: Scope = Field(description="'org/team' whose sessions' agents these bound.")
    launchers: list[str] = Field(
        default_factory=lambda: ["local"],
        description="Launchers agents may name: 'local' (sandboxed processes) or saved "
        "blocks as 'sagemaker:NAME', 'vertex:NAME', 'deployment:NAME'.",
    )
    callables: list[str] = Field(
        default_factory=list, description="'module:function' trials agents may call."
    )
    max_priority: int = Field(0, ge=-1000, le=1000, description="Highest priority an agent sets.")
    max_wait: Annotated[float, BeforeValidator(lambda v: parse_duration(v, "max_wait"))] = Field(
        default=3600.0,
        description="Longest max_wait an agent sets (an agent job never waits "
        "forever), in seconds or like '1h'.",
    )
    max_sweeps: int = Field(2, ge=0, le=1000, description="Sweeps a session runs at once.")
    max_queued: int = Field(
        AGENT_MAX_QUEUED, ge=0, le=100_000, description="Jobs a session has queued at once."
    )
    max_trials: int = Field(100, ge=1, le=10_000, description="Trials in one sweep.")

    @field_validator("launchers")
    @classmethod
    def _launchers(cls, value: list[str]) -> list[str]:
        for ref in value:
            if ref.startswith("deployment:"):
                raise BudgetInputError("launchers", DEPLOYMENT_REFUSED)
            if ref != "local" and not re.fullmatch(
                r"(vertex|sagemaker):[a-z0-9][a-z0-9-]{0,99}", ref
            ):
                raise BudgetInputError(
                    "launchers", f"'local' or 'kind:block-name', got {shown(ref)}"
                )
        return value

    @field_validator("callables")
    @classmethod
    def _callables(cls, value: list[str]) -> list[str]:
        for ref in value:
            if not re.fullmatch(r"[\w.]+:\w+", ref):
                raise BudgetInputError("callables", f"must be 'module:function', got {shown(ref)}")
        return value

    def stored(self) -> dict[str, object]:
        """What the ledger keeps (the team is its key)."""
        return self.model_dump(mode="json", exclude={"team"})


class PriorityClassSettings(BaseModel):
    """One of an org's own priority classes (see `priorities`)."""

    model_config = ConfigDict(extra="forbid")

    org: Scope = Field(description="The org whose jobs may name it.")
    name: str = Field(description="What jobs give as `priority`.")
    value: int = Field(description="-1000..1000: higher is admitted first, and may preempt.")
    description: str = Field("", max_length=200, description="What the class is for.")


def limits_for(grants: Grants, session: str) -> AgentLimits:
    """The ceilings for the agents of `session`'s team (`grants`: the ledger's): the admin's,
    or the defaults."""
    team = session.rsplit("/", 1)[0]
    return AgentLimits(team=team, **(grants.agent_limits(team) or {}))
