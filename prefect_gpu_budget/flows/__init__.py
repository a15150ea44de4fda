"""Flows: sweeps with results and plots, the spend report, reconcile, and the demo."""

from prefect_gpu_budget.flows.agent import agent_cancel, agent_sweep
from prefect_gpu_budget.flows.reconcile import reconcile_flow
from prefect_gpu_budget.flows.spend_report import spend_report
from prefect_gpu_budget.flows.sweep import SweepSpec, gpu_sweep

__all__ = [
    "SweepSpec",
    "agent_cancel",
    "agent_sweep",
    "gpu_sweep",
    "reconcile_flow",
    "spend_report",
]
