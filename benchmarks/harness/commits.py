"""What a ledger's engine does per admission, counted (not timed): the write transactions it
commits and the locks they take. Counted on SQLAlchemy's events, so the same counter reads any
tree of the package (`benchmarks.hosts --before`).

- `commits`: write transactions committed (a read's transaction, `Db.read`, is not counted);
- `org_locks`: the org's advisory lock taken (PostgreSQL: `pg_advisory_xact_lock`), or, on
  SQLite, its one writer lock (`BEGIN IMMEDIATE`), which every write takes;
- `statements`: every statement sent, reads' included (on PostgreSQL each is a round trip);
- `under_lock`: the statements a transaction sent while it held the org's lock, the lock's own
  included, up to its commit or rollback: the lock's hold counted in round trips, not timed.
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa


class LedgerCounts:
    """Counts on `engine` from now on; `snapshot()` reads them, `close()` stops counting."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.commits = self.org_locks = self.statements = self.under_lock = 0
        self._lock = threading.Lock()
        sa.event.listen(engine, "commit", self._commit)
        sa.event.listen(engine, "rollback", self._unlocked)
        sa.event.listen(engine, "before_cursor_execute", self._statement)

    def _commit(self, conn: Any) -> None:
        self._unlocked(conn)
        if conn.get_execution_options().get("gpu_budget_read"):
            return
        with self._lock:
            self.commits += 1

    def _unlocked(self, conn: Any) -> None:
        conn.info.pop("counted_org_lock", None)  # a transaction's lock ends with it

    def _statement(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        locks = "pg_advisory_xact_lock" in statement or statement.startswith("BEGIN IMMEDIATE")
        if locks:
            conn.info["counted_org_lock"] = True
        with self._lock:
            self.statements += 1
            self.org_locks += locks
            self.under_lock += bool(conn.info.get("counted_org_lock"))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "commits": self.commits,
                "org_locks": self.org_locks,
                "statements": self.statements,
                "under_lock": self.under_lock,
            }

    def close(self) -> None:
        sa.event.remove(self.engine, "commit", self._commit)
        sa.event.remove(self.engine, "rollback", self._unlocked)
        sa.event.remove(self.engine, "before_cursor_execute", self._statement)
