from prefect_gpu_budget.blocks.budget import GpuBudget
from prefect_gpu_budget.blocks.ledger import SpendLedger

__all__ = ["GpuBudget", "SpendLedger"]
