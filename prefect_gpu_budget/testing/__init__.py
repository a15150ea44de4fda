"""What the suite and the benchmarks share, as Prefect's own `prefect.testing` does: a real
`prefect server start` of one's own (`servers`), a PostgreSQL database of one's own
(`postgres`), and the order statistics and trends of a run's samples (`stats`). Nothing of the
product imports it."""
