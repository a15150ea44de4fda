"""prefect-gpu-budget: spend bounds around agent-launched GPU experiments, for Prefect 3."""

from prefect_gpu_budget.admission.gate import Admission, AdmissionRefused, Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.blocks import CapacityPool, GpuBudget, SpendLedger
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.tasks import JobResult, admit, run_gpu_job, settle

__all__ = [
    "Admission",
    "AdmissionRefused",
    "CapacityPool",
    "Gate",
    "GpuBudget",
    "GpuJob",
    "JobResult",
    "Ledger",
    "SpendLedger",
    "admit",
    "run_gpu_job",
    "settle",
]
