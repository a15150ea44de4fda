from prefect_gpu_budget.tasks.gpu_job import JobResult, admit, run_gpu_job, settle
from prefect_gpu_budget.tasks.gpu_task import CurrentJob, GpuTask, current_job, gpu_task

__all__ = [
    "CurrentJob",
    "GpuTask",
    "JobResult",
    "admit",
    "current_job",
    "gpu_task",
    "run_gpu_job",
    "settle",
]
