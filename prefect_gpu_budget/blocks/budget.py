"""`GpuBudget`: a scope's hourly cap and period budget, as a Prefect block."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal

from prefect.blocks.core import Block
from pydantic import BeforeValidator, Field, field_validator

from prefect_gpu_budget.admission import periods
from prefect_gpu_budget.admission.policy import BudgetRule
from prefect_gpu_budget.units import (
    MAX_CAP_CENTS,
    MAX_CAP_RULE,
    MICRO_PER_USD,
    BudgetInputError,
    Scope,
    cap_cents,
    parse_duration,
    shown,
    to_decimal_usd,
    usd_to_micro,
)


def _usd(field: str):  # noqa: ANN202 - a pydantic validator factory
    return BeforeValidator(lambda v: None if v is None else to_decimal_usd(v, field))


class GpuBudget(Block):
    """Spend bounds for a scope (`org`, `org/team` or `org/team/session`).

    A job must fit every budget on its scope's path at once: the hourly cap (its rate plus the
    rates of the scope's running jobs) and the period budget (settled plus reserved spend plus
    its own reservation, in the calendar period).
    """

    _block_type_name = "GPU Budget"
    _block_type_slug = "gpu-budget"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "Hourly rate cap and calendar-period budget for GPU jobs in one scope."

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

    def apply(self, ledger: object | None = None) -> None:
        """Write this budget into the ledger (the default one unless given)."""
        from prefect_gpu_budget.blocks.ledger import SpendLedger

        (ledger or SpendLedger().ledger()).set_budget(self.rule())
