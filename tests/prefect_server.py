"""The real `prefect server start` of the tests: the benchmarks' harness (see
benchmarks/harness/servers.py)."""

from benchmarks.harness.servers import PrefectServer, free_port, http, stop_groups, wait_for

__all__ = ["PrefectServer", "free_port", "http", "stop_groups", "wait_for"]
