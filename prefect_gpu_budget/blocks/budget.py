"""`GpuBudget`: a scope's hourly cap and period budget, as a Prefect block."""

from __future__ import annotations

import logging

from prefect.blocks.core import Block

from prefect_gpu_budget.admission.admin_settings import BudgetSettings

logger = logging.getLogger(__name__)


class GpuBudget(Block, BudgetSettings):
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

    def apply(self, ledger: object | None = None, *, new: bool = False) -> list[str]:
        """Write this budget into the ledger (the default one unless given), as `budget set`
        does (`admission.budgets.set_budget`): a scope whose org or team has no budget yet and
        whose name is close to a known one is refused unless `new`; Prefect's limit of the
        scope takes the new cap at once. Returns the warnings (a cap above a parent's, which
        binds; a cap that is not whole cents), each logged as well."""
        from prefect_gpu_budget.admission.budgets import set_budget
        from prefect_gpu_budget.blocks.ledger import SpendLedger

        fields = BudgetSettings.fields_of(self.rule())  # every field: the block is whole
        del fields["scope"]
        fields.update(hourly_cap_usd=self.hourly_cap_usd, period_budget_usd=self.period_budget_usd)
        done = set_budget(
            ledger or SpendLedger().ledger(), self.scope, fields, new=new, need_a_bound=False
        )
        for warning in done.warnings:
            logger.warning("%s", warning)
        return done.warnings
