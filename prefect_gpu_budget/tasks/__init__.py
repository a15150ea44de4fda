from prefect_gpu_budget.tasks.defaults import JobDefaults, job_defaults
from prefect_gpu_budget.tasks.gpu_job import JobResult, admit, run_gpu_job, settle
from prefect_gpu_budget.tasks.gpu_task import CurrentJob, GpuTask, current_job, gpu_task

__all__ = [
    "CurrentJob",
    "GpuTask",
    "JobDefaults",
    "JobResult",
    "admit",
    "current_job",
    "gpu_task",
    "job_defaults",
    "run_gpu_job",
    "settle",
]
