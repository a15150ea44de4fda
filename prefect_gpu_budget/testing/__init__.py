"""What the suite and the benchmarks share, as Prefect's own `prefect.testing` does: a real
`prefect server start` of one's own (`servers`) and a PostgreSQL database of one's own
(`postgres`). Nothing of the product imports it."""
