"""Prefect worker types whose flow runs pass the budget gate before they start."""

PROCESS_TYPE = "gpu-budget-process"
VERTEX_TYPE = "gpu-budget-vertex-ai"
GATED_TYPES = (PROCESS_TYPE, VERTEX_TYPE)
"""The worker types that gate every flow run they take (a deployment launcher refuses them:
its job would be reserved twice)."""
