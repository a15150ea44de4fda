"""What the benchmarks share: a real Prefect server and a PostgreSQL database of one's own
(from `prefect_gpu_budget.testing`, which the tests use too), a ledger with its gate tables
made afresh (`ledger`, not imported here: it imports the product), what `/proc` tells of
processes and the host (`host`), and the tables of a report (`report`); the figures' order
statistics and trends are `prefect_gpu_budget.testing.stats`, which the tests check."""

from benchmarks.harness import report
from prefect_gpu_budget.testing.postgres import drop_database, ensure_database, postgres_database
from prefect_gpu_budget.testing.servers import PrefectServer, prefect_server, serving

__all__ = [
    "PrefectServer",
    "drop_database",
    "ensure_database",
    "postgres_database",
    "prefect_server",
    "report",
    "serving",
]
