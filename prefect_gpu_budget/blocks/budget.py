"""`GpuBudget`: a scope's hourly cap and period budget, as a Prefect block."""

from __future__ import annotations

from prefect.blocks.core import Block

from prefect_gpu_budget.models import BudgetSettings


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

    def apply(self, ledger: object | None = None) -> None:
        """Write this budget into the ledger (the default one unless given)."""
        from prefect_gpu_budget.blocks.ledger import SpendLedger

        (ledger or SpendLedger().ledger()).config.set_budget(self.rule())
