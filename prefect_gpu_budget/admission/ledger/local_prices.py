"""The prices of local machines (`local:NAME`), kept in the ledger.

A local machine's price was a CSV in the home of the host where `prices set-local` ran, so two
hosts on one ledger could price one machine differently. Kept here, every host and replica on
the ledger reads one list; a CSV is only an import and an export (`prices import-local`,
`prices export-local`). The rows are the catalog's columns as text (`admission.prices` parses
and checks them as `pricing.catalog` does a CSV's), the price exactly as it was given.

`stored_rows(url)` reads the list of a ledger by its URL for the catalog (`admission.prices`
hands it in), creating nothing: a SQLite ledger not made yet, or one made by an earlier version
without the table, has none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger.engine import Db, normalise_url, reconnecting
from prefect_gpu_budget.admission.ledger.tables import local_prices

FIELDS = ("name", "usd_per_hour", "gpu_model", "gpus", "vcpu", "memory_gib", "source", "as_of")
"""A row's fields, as `rows` gives them and `set` takes them."""


class LocalPrices:
    """The local machines' price list of one ledger."""

    def __init__(self, db: Db) -> None:
        self.db = db

    @reconnecting
    def rows(self) -> list[dict[str, str]]:
        """Every local machine's row, by name, its fields as text."""
        with self.db.read() as conn:
            found = conn.execute(sa.select(local_prices).order_by(local_prices.c.name)).all()
        return [{f: str(getattr(r, f)) for f in FIELDS} for r in found]

    @reconnecting
    def set(self, row: dict[str, object], now: float | None = None) -> None:
        """Price `row["name"]`, replacing its older row (one transaction: a reader sees the old
        price or the new, never none)."""
        values = {f: row[f] for f in FIELDS}
        values["set_at"] = time.time() if now is None else now
        with self.db.tx() as conn:
            conn.execute(local_prices.delete().where(local_prices.c.name == values["name"]))
            conn.execute(local_prices.insert().values(**values))

    @reconnecting
    def remove(self, name: str) -> bool:
        """Forget `name`'s price; whether it had one."""
        with self.db.tx() as conn:
            gone = conn.execute(local_prices.delete().where(local_prices.c.name == name))
        return gone.rowcount > 0


logger = logging.getLogger(__name__)
_dbs: dict[str, Db] = {}
_dbs_lock = threading.Lock()


def stored_rows(url: str) -> list[dict[str, str]]:
    """The local price list of the ledger at `url`, without creating it or its tables: none
    where the SQLite file does not exist yet or the table was never made."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if not path or path == ":memory:" or not Path(path).exists():
            return []
    with _dbs_lock:
        key = f"{os.getpid()}:{url}"  # a forked child opens its own connections
        db = _dbs.get(key)
        if db is None:
            db = _dbs[key] = Db(url)
    try:
        return LocalPrices(db).rows()
    except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
        if _no_table(exc):
            return []
        if not isinstance(exc, sa.exc.OperationalError):
            raise
        # the ledger cannot be reached (down, a wrong URL): prices come from this host's files
        # alone, as before the ledger held any; no admission is decided without it anyway
        logger.warning("local prices: the ledger could not be read (%s)", type(exc.orig).__name__)
        return []


def _no_table(exc: Exception) -> bool:
    """Whether `exc` says the table does not exist (a ledger of an earlier version)."""
    text = str(exc).lower()
    return "gpu_local_prices" in text and ("no such table" in text or "does not exist" in text)
