"""Prefect worker types whose flow runs pass the budget gate before they start: `process` and
`vertex` (their names: `prefect_gpu_budget.worker_types`), on the gate in `gating`."""
