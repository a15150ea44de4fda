from prefect_gpu_budget.blocks.billing import BillingExport
from prefect_gpu_budget.blocks.budget import GpuBudget
from prefect_gpu_budget.blocks.capacity import CapacityPool, TeamShare
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.blocks.priority import GpuPriorityClass

__all__ = [
    "BillingExport",
    "CapacityPool",
    "GpuBudget",
    "GpuPriorityClass",
    "SpendLedger",
    "TeamShare",
]
