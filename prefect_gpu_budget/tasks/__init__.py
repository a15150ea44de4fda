from prefect_gpu_budget.tasks.gpu_job import JobResult, admit, run_gpu_job, settle

__all__ = ["JobResult", "admit", "run_gpu_job", "settle"]
