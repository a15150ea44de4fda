"""What the benchmarks and the tests share: one way to start a real Prefect server
(`servers`), one way to get a PostgreSQL database of one's own and read its statistics
(`postgres`), a ledger with its gate tables made afresh (`ledger`, not imported here: it
imports the product), what `/proc` tells of processes and the host (`host`), and the figures
and tables of a report (`stats`, `report`)."""

from benchmarks.harness import report, stats
from benchmarks.harness.postgres import drop_database, ensure_database, postgres_database
from benchmarks.harness.servers import PrefectServer, prefect_server, serving

__all__ = [
    "PrefectServer",
    "drop_database",
    "ensure_database",
    "postgres_database",
    "prefect_server",
    "report",
    "serving",
    "stats",
]
