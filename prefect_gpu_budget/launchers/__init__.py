from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    Launcher,
    LaunchResult,
    Probe,
)
from prefect_gpu_budget.launchers.local import LocalLauncher

__all__ = ["LaunchConfigError", "LaunchResult", "Launcher", "LocalLauncher", "Probe"]
