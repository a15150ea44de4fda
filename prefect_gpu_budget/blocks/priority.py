"""`GpuPriorityClass`: one of an org's own priority classes, as a Prefect block."""

from __future__ import annotations

from prefect.blocks.core import Block

from prefect_gpu_budget.admission.admin_settings import PriorityClassSettings

__all__ = ["GpuPriorityClass"]


class GpuPriorityClass(Block, PriorityClassSettings):
    """A named priority an org's jobs may give (`priority: urgent`), as Kueue's
    WorkloadPriorityClass: `apply()` defines it in the ledger, where admission resolves it."""

    _block_type_name = "GPU Priority Class"
    _block_type_slug = "gpu-priority-class"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "A named job priority of an org, resolved by the gate at admission."

    def apply(self, ledger: object | None = None) -> None:
        """Define the class in the ledger (the default one unless given)."""
        from prefect_gpu_budget.blocks.ledger import SpendLedger

        led = ledger or SpendLedger().ledger()
        led.config.set_priority_class(self.org, self.name, self.value, self.description)
