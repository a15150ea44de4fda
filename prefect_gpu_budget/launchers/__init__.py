from prefect_gpu_budget.launchers.local import LaunchResult, LocalLauncher

__all__ = ["LaunchResult", "LocalLauncher"]
