from prefect_gpu_budget.blocks.budget import GpuBudget
from prefect_gpu_budget.blocks.capacity import CapacityPool, TeamShare
from prefect_gpu_budget.blocks.ledger import SpendLedger

__all__ = ["CapacityPool", "GpuBudget", "SpendLedger", "TeamShare"]
