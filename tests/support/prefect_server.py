"""The real `prefect server start` of the tests, shared with the benchmarks
(prefect_gpu_budget/testing/servers.py)."""

from prefect_gpu_budget.testing.servers import PrefectServer, free_port, http, stop_groups, wait_for

__all__ = ["PrefectServer", "free_port", "http", "stop_groups", "wait_for"]
