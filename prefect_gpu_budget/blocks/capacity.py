"""`CapacityPool`: what can run at once, and each team's quota of it, as a Prefect block."""

from __future__ import annotations

from prefect.blocks.core import Block

from prefect_gpu_budget.admission.admin_settings import PoolSettings, TeamShare

__all__ = ["CapacityPool", "TeamShare"]


class CapacityPool(Block, PoolSettings):
    """Machines (an on-prem inventory: `nodes` of one shape) or a cloud quota (totals only)
    that jobs of some instance types run on, and the teams' quotas of it.

    A job is admitted only when all its nodes fit at once, its team's quota (plus what it may
    borrow of idle capacity) allows it, and every budget on its path does.
    """

    _block_type_name = "GPU Capacity Pool"
    _block_type_slug = "gpu-capacity-pool"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "GPU machines or a cloud GPU quota, with per-team quotas, lending and borrowing."

    def apply(self, ledger: object | None = None) -> None:
        """Write the pool and its team quotas into the ledger (the default one unless given)."""
        from prefect_gpu_budget.blocks.ledger import SpendLedger

        (ledger or SpendLedger().ledger()).config.set_pool(self.pool(), self.quotas())
