"""The names of the Prefect worker types whose flow runs pass the budget gate before they start
(`workers/`). Names only, on the bottom floor: the deployment launcher refuses a pool of these
types without importing the workers."""

PROCESS_TYPE = "gpu-budget-process"
VERTEX_TYPE = "gpu-budget-vertex-ai"
GATED_TYPES = (PROCESS_TYPE, VERTEX_TYPE)
"""The worker types that gate every flow run they take (a deployment launcher refuses them:
its job would be reserved twice)."""
