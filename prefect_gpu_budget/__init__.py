"""prefect-gpu-budget: spend bounds around agent-launched GPU experiments, for Prefect 3.

The public names load on first use (PEP 562), so that a trial, a launcher's subprocess or a
ledger command of the CLI pays only for what it uses: `import prefect_gpu_budget` imports
neither Prefect nor pandas. Prefect's collection loader imports `prefect_gpu_budget.collection`
(the blocks and the worker types); `prefect block register -m prefect_gpu_budget` finds every
block, launchers included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_gpu_budget._lazy import lazy_exports

_PUBLIC = {
    "Admission": "prefect_gpu_budget.admission.holding",
    "AdmissionRefused": "prefect_gpu_budget.admission.gate",
    "BillingExport": "prefect_gpu_budget.blocks",
    "CapacityPool": "prefect_gpu_budget.blocks",
    "DeploymentLauncher": "prefect_gpu_budget.launchers.deployment",
    "Gate": "prefect_gpu_budget.admission.gate",
    "GpuBudget": "prefect_gpu_budget.blocks",
    "GpuJob": "prefect_gpu_budget.job",
    "GpuPriorityClass": "prefect_gpu_budget.blocks",
    "JobResult": "prefect_gpu_budget.tasks",
    "Ledger": "prefect_gpu_budget.admission.ledger",
    "SageMakerLauncher": "prefect_gpu_budget.launchers.sagemaker",
    "SpendLedger": "prefect_gpu_budget.blocks",
    "VertexLauncher": "prefect_gpu_budget.launchers.vertex",
    "admit": "prefect_gpu_budget.tasks",
    "current_job": "prefect_gpu_budget.tasks",
    "gpu_task": "prefect_gpu_budget.tasks",
    "job_defaults": "prefect_gpu_budget.tasks",
    "run_gpu_job": "prefect_gpu_budget.tasks",
    "settle": "prefect_gpu_budget.tasks",
}

__all__ = [
    "Admission",
    "AdmissionRefused",
    "BillingExport",
    "CapacityPool",
    "DeploymentLauncher",
    "Gate",
    "GpuBudget",
    "GpuJob",
    "GpuPriorityClass",
    "JobResult",
    "Ledger",
    "SageMakerLauncher",
    "SpendLedger",
    "VertexLauncher",
    "admit",
    "current_job",
    "gpu_task",
    "job_defaults",
    "run_gpu_job",
    "settle",
]

if TYPE_CHECKING:
    from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
    from prefect_gpu_budget.admission.holding import Admission
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.blocks import (
        BillingExport,
        CapacityPool,
        GpuBudget,
        GpuPriorityClass,
        SpendLedger,
    )
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.launchers.deployment import DeploymentLauncher
    from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher
    from prefect_gpu_budget.launchers.vertex import VertexLauncher
    from prefect_gpu_budget.tasks import (
        JobResult,
        admit,
        current_job,
        gpu_task,
        job_defaults,
        run_gpu_job,
        settle,
    )


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
