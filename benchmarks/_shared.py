"""What the benchmark scripts share: their PostgreSQL databases and their tables."""

from __future__ import annotations

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import normalise_url


def ensure_database(url: str) -> None:
    """Create the PostgreSQL database named in `url` if its server lacks it; raise if the server
    is unreachable."""
    url = normalise_url(url)
    server = sa.create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    name = url.rsplit("/", 1)[1]
    try:
        with server.connect() as conn:
            found = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).first()
            if not found:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        server.dispose()


def drop_database(url: str) -> None:
    """Drop the PostgreSQL database named in `url`: only for one its caller created."""
    url = normalise_url(url)
    server = sa.create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
    finally:
        server.dispose()


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, padded so it also reads as plain text."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])
