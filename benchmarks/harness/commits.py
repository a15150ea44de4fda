"""What a ledger's engine does per admission, counted (not timed): the write transactions it
commits and the locks they take. Counted on SQLAlchemy's events, so the same counter reads any
tree of the package (`benchmarks.hosts --before`).

- `commits`: write transactions committed (a read's transaction, `Db.read`, is not counted);
- `org_locks`: the org's advisory lock taken (PostgreSQL: `pg_advisory_xact_lock`), or, on
  SQLite, its one writer lock (`BEGIN IMMEDIATE`), which every write takes;
- `statements`: every statement sent, reads' included (on PostgreSQL each is a round trip).
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa


class LedgerCounts:
    """Counts on `engine` from now on; `snapshot()` reads them, `close()` stops counting."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.commits = self.org_locks = self.statements = 0
        self._lock = threading.Lock()
        sa.event.listen(engine, "commit", self._commit)
        sa.event.listen(engine, "before_cursor_execute", self._statement)

    def _commit(self, conn: Any) -> None:
        if conn.get_execution_options().get("gpu_budget_read"):
            return
        with self._lock:
            self.commits += 1

    def _statement(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        locks = "pg_advisory_xact_lock" in statement or statement.startswith("BEGIN IMMEDIATE")
        with self._lock:
            self.statements += 1
            self.org_locks += locks

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "commits": self.commits,
                "org_locks": self.org_locks,
                "statements": self.statements,
            }

    def close(self) -> None:
        sa.event.remove(self.engine, "commit", self._commit)
        sa.event.remove(self.engine, "before_cursor_execute", self._statement)
