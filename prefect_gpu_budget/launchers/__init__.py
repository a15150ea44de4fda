"""Launchers run admitted jobs: local processes, Vertex AI custom jobs, SageMaker training jobs,
or flow runs of any Prefect deployment. The cloud ones load their SDKs on first use."""

from typing import Any

from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    Launcher,
    LauncherNeedsExtra,
    LaunchResult,
    Probe,
)
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.sandbox.launcher import Sandbox

_LAZY = {
    "DeploymentLauncher": "prefect_gpu_budget.launchers.deployment",
    "SageMakerLauncher": "prefect_gpu_budget.launchers.sagemaker",
    "VertexLauncher": "prefect_gpu_budget.launchers.vertex",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "DeploymentLauncher",
    "LaunchConfigError",
    "LaunchResult",
    "Launcher",
    "LauncherNeedsExtra",
    "LocalLauncher",
    "Probe",
    "SageMakerLauncher",
    "Sandbox",
    "VertexLauncher",
]
