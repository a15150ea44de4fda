"""The one place that remembers: the spend ledger in SQL (SQLite by default, PostgreSQL shared).

Every admission is a row in `gpu_jobs` from request to settlement (its states: `tables`).
Admission and settlement run in a transaction serialised per org (SQLite: `BEGIN IMMEDIATE`;
PostgreSQL: a transaction-scoped advisory lock on the org), so any number of processes on any
number of machines see one order. Settled spend is also summed per (scope, period) in
`gpu_period_spend`, so a decision reads a few rows however long the ledger grows.

`Ledger` is assembled from one mixin per concern:

- `engine`: URLs, the engine, transactions, the schema, the version bump and its notices;
- `decisions`: the admission transaction, the org's queue, unadmitting and cancelling;
- `settlement`: a started job's writes and its settlement;
- `config`: budgets, session templates, pools and team quotas, priority classes;
- `agents`: agent grants (tokens) and the limits on a team's agents;
- `reads`: versions, states, jobs, status and the other read models;

with the tables in `tables` and the rows' domain values in `rows`. Every name other modules
import from `prefect_gpu_budget.admission.ledger` is re-exported here.
"""

from __future__ import annotations

import threading

from prefect_gpu_budget.admission.ledger.agents import AgentsMixin
from prefect_gpu_budget.admission.ledger.config import ConfigMixin, check_pool, check_rule
from prefect_gpu_budget.admission.ledger.decisions import (
    LEARNED_OUTCOMES,
    OVERRUN_REFRESH_S,
    OVERRUN_SAMPLE,
    DecisionsMixin,
    NewJob,
)
from prefect_gpu_budget.admission.ledger.engine import (
    NOTICE_CHANNEL,
    EngineMixin,
    LedgerFileReplaced,
    OrgLock,
    _make_engine,
    default_url,
    normalise_url,
    notice_payloads,
    read_notice,
)
from prefect_gpu_budget.admission.ledger.reads import ReadsMixin, wait_spans
from prefect_gpu_budget.admission.ledger.rows import hold_of, wait_key
from prefect_gpu_budget.admission.ledger.settlement import SettlementMixin
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
from prefect_gpu_budget.admission.timing import STALE_AFTER_S, STALE_WAITER_S
from prefect_gpu_budget.identity import holder_alive, holder_id, process_start_ticks
from prefect_gpu_budget.units import AGENT_MAX_QUEUED

__all__ = [
    "ACTIVE",
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


class Ledger(DecisionsMixin, SettlementMixin, ConfigMixin, AgentsMixin, ReadsMixin, EngineMixin):
    """Durable admission records. Safe to share between threads and processes."""

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        self.url = normalise_url(url or default_url())
        self.engine = _make_engine(self.url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._org_locks: dict[str, OrgLock] = {}
        self._held = threading.local()
        self._overrun_cache: dict[str, tuple[float, dict[str, float]]] = {}
        self._asks = {}
        if create:
            self.create()


_open: dict[str, Ledger] = {}
_opening = threading.Lock()


def open_ledger(url: str) -> Ledger:
    """The one open ledger of this process for `url` (its engine pools the connections of every
    job in the process), built once even when many threads ask for it at the same moment."""
    with _opening:
        if url not in _open:
            _open[url] = Ledger(url)
        return _open[url]
