"""Launcher references in the ledger: `kind` or `kind:saved-block-name`.

A ledger row names the launcher that ran its job, so that reconcile (in another process, maybe
days later) can ask that launcher about it: a saved launcher block is loaded by name; a launcher
built in code is handed to reconcile by kind.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from prefect_gpu_budget.launchers.base import Launcher

_BLOCKS = {
    "vertex": "prefect_gpu_budget.launchers.vertex:VertexLauncher",
    "sagemaker": "prefect_gpu_budget.launchers.sagemaker:SageMakerLauncher",
    "deployment": "prefect_gpu_budget.launchers.deployment:DeploymentLauncher",
}


def launcher_ref(launcher: Launcher) -> str:
    """What the ledger records: the kind, plus the block's saved name when it has one."""
    name = getattr(launcher, "_block_document_name", None)
    return f"{launcher.kind}:{name}" if name else launcher.kind


def launcher_for(ref: str, given: Mapping[str, Launcher] | None = None) -> Launcher | None:
    """The launcher a ledger row names: one handed in by kind, else its saved block, else None."""
    kind, _, name = ref.partition(":")
    if given and kind in given:
        return given[kind]
    if kind == "local":
        from prefect_gpu_budget.launchers.local import LocalLauncher

        return LocalLauncher()
    if name and kind in _BLOCKS:
        module, _, cls = _BLOCKS[kind].partition(":")
        return getattr(importlib.import_module(module), cls).load(name)
    return None
