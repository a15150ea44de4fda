"""The one place that remembers: the spend ledger in SQL (SQLite by default, PostgreSQL shared).

Every admission is a row in `gpu_jobs` from request to settlement (its states: `tables`).
Admission and settlement run in a transaction serialised per org (SQLite: `BEGIN IMMEDIATE`;
PostgreSQL: a transaction-scoped advisory lock on the org), so any number of processes on any
number of machines see one order. Settled spend is also summed per (scope, period) in
`gpu_period_spend`, so a decision reads a few rows however long the ledger grows.

A `Ledger` is one database object and the stores over it, each a class of its own whose
collaborators are passed in:

- `ledger.db` (`engine.Db`): URLs, the engine, transactions, the schema, the version bump and
  its notices;
- `ledger.queue` (`queue.Queue`): the admission transaction, the org's queue (`headroom`,
  which every write that may have made room ends in), unadmitting and cancelling;
- `ledger.settlements` (`settlement.Settlements`): a started job's writes and its settlement;
- `ledger.config` (`config.Config`): budgets, session templates, pools and team quotas,
  priority classes;
- `ledger.grants` (`grants.Grants`): agent grants (tokens) and the limits on a team's agents;
- `ledger.views` (`views.Views`): versions, states, jobs, status and the other read models;
- `ledger.bills` (`bills.Bills`): the clouds' bills as imported, and their true-up of the
  period spend;
- `ledger.sweeps` (`sweep_records.SweepRecords`): the sweeps' results (trials, records,
  outputs), which the sweep flow writes and the agent gateway reads;

with the tables in `tables`, the rows' domain values in `rows`, and the SQL several stores share
in `queries` (functions over a connection; `queries.subtree` is a scope and every scope under
it). Every name other modules import from
`prefect_gpu_budget.admission.ledger` is re-exported here.
"""

from __future__ import annotations

import threading

from prefect_gpu_budget.admission.ledger.bills import Bills
from prefect_gpu_budget.admission.ledger.config import Config, check_pool, check_rule
from prefect_gpu_budget.admission.ledger.engine import (
    NOTICE_CHANNEL,
    Db,
    LedgerFileReplaced,
    default_url,
    normalise_url,
    notice_payloads,
    read_notice,
)
from prefect_gpu_budget.admission.ledger.grants import Grants
from prefect_gpu_budget.admission.ledger.queue import Queue
from prefect_gpu_budget.admission.ledger.rows import (
    LEARNED_OUTCOMES,
    OVERRUN_REFRESH_S,
    OVERRUN_SAMPLE,
    NewJob,
    hold_of,
    wait_key,
)
from prefect_gpu_budget.admission.ledger.settlement import Settlements
from prefect_gpu_budget.admission.ledger.sweep_records import SweepRecords
from prefect_gpu_budget.admission.ledger.tables import (
    ACTIVE,
    FINAL,
    PREEMPTED,
    SCHEMA,
    STOPPED,
    agent_grants,
    agent_limits,
    budgets,
    jobs,
    metadata,
    period_spend,
    pools,
    priority_classes,
    schema,
    team_quotas,
    templates,
    versions,
)
from prefect_gpu_budget.admission.ledger.views import Views, wait_spans
from prefect_gpu_budget.admission.rules.timing import STALE_AFTER_S, STALE_WAITER_S
from prefect_gpu_budget.identity import holder_alive, holder_id, process_start_ticks
from prefect_gpu_budget.units import AGENT_MAX_QUEUED

__all__ = [
    "ACTIVE",
    "Config",
    "Db",
    "Grants",
    "Queue",
    "Settlements",
    "SweepRecords",
    "Views",
    "AGENT_MAX_QUEUED",
    "FINAL",
    "LEARNED_OUTCOMES",
    "NOTICE_CHANNEL",
    "OVERRUN_REFRESH_S",
    "OVERRUN_SAMPLE",
    "PREEMPTED",
    "SCHEMA",
    "STALE_AFTER_S",
    "STALE_WAITER_S",
    "STOPPED",
    "Ledger",
    "LedgerFileReplaced",
    "NewJob",
    "agent_grants",
    "agent_limits",
    "budgets",
    "check_pool",
    "check_rule",
    "default_url",
    "hold_of",
    "holder_alive",
    "holder_id",
    "jobs",
    "metadata",
    "normalise_url",
    "notice_payloads",
    "open_ledger",
    "period_spend",
    "pools",
    "priority_classes",
    "process_start_ticks",
    "read_notice",
    "schema",
    "team_quotas",
    "templates",
    "versions",
    "wait_key",
    "wait_spans",
]


class Ledger:
    """Durable admission records: the database and its stores (see the module's docstring).
    Safe to share between threads and processes."""

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        self.db = Db(url)
        self.url = self.db.url
        self.queue = Queue(self.db)
        self.settlements = Settlements(self.db, self.queue.headroom)
        self.config = Config(self.db, self.queue.headroom)
        self.grants = Grants(self.db, self.queue.headroom)
        self.views = Views(self.db)
        self.bills = Bills(self.db, self.queue.headroom)
        self.sweeps = SweepRecords(self.db)
        if create:
            self.db.create()


_open: dict[str, Ledger] = {}
_opening = threading.Lock()


def open_ledger(url: str) -> Ledger:
    """The one open ledger of this process for `url` (its engine pools the connections of every
    job in the process), built once even when many threads ask for it at the same moment."""
    with _opening:
        if url not in _open:
            _open[url] = Ledger(url)
        return _open[url]
