"""The soak's settings: the job mix and its timings, the targets, the run's `Config` and an
agent's `AgentConfig`, and the nested budgets every run sets."""

from __future__ import annotations

import math
import os
import signal
from collections import Counter
from dataclasses import dataclass, field

from benchmarks.harness.report import logger
from prefect_gpu_budget.admission.rules.policy import BudgetRule

PG_URL = os.environ.get("GATE_SOAK_PG_URL")
"""The ledger's database; None: one of the run's own."""
ORG = "soak"
INSTANCE = "local:soak"
PRICE_USD = "3.60"
RATE_CENTS = 360
AGENTS_PER_TEAM = 4
IN_FLIGHT = 3
SESSION_JOBS = 2
MAX_RUNTIME_S, KILL_GRACE_S = 30, 1
RUN_S = (0.2, 2.0)
THINK_S = (0.0, 1.5)
KINDS = {"run": 55, "impatient": 15, "interrupt": 20, "withdraw": 10}
BUDGET_MAX_WAIT_S = 120.0
"""A job with no max_wait of its own times out after this: it counts as starved."""
DRAIN_S = 30.0
"""A job still waiting this long after the run ended is cancelled and counted as stuck."""
SILENT_S = 30.0
"""An agent whose samples stop this long has hung: its threads' stacks go to its log."""
DUMP_SIGNAL = signal.SIGUSR2
TARGETS = {"latency_p95_ratio": 1.2, "rss_growth_mib": 8.0}
GROUPS, MIN_GROUP = 5, 20
STREAMS = {
    "admit": "admit, not waiting",
    "wake": "admit after a wait",
    "decide": "ledger decision",
    "acquire": "Prefect acquire",
}
APP_NAME = "prefect-gpu-budget"
MESSAGES = 10
"""The audit's findings reported one by one; more are counted."""
FAILURES = ("errors", "rejected", "starved", "stuck")
"""Counts that must stay 0: a job the gate failed, refused outright, or never decided."""


log = logger("soak")


@dataclass(frozen=True)
class AgentConfig:
    index: int
    scope: str
    ledger_url: str
    prices: str
    out: str
    sample_s: float
    seed: int
    mix: dict[str, int]


@dataclass(frozen=True)
class Config:
    minutes: float
    agents: int
    url: str
    warmup_s: float
    edge: float
    sample_s: float
    seed: int
    mix: dict[str, int] = field(default_factory=lambda: dict(KINDS))
    keep: str | None = None

    @property
    def run_s(self) -> float:
        return self.minutes * 60

    def scopes(self) -> list[str]:
        return [f"{ORG}/team-{i // AGENTS_PER_TEAM}/agent-{i}" for i in range(self.agents)]


def budgets(cfg: Config) -> list[BudgetRule]:
    """Hourly caps that make jobs wait at every level; period budgets that never bind."""
    teams = Counter(s.rsplit("/", 1)[0] for s in cfg.scopes())
    team_jobs = {team: math.ceil(1.5 * size) for team, size in teams.items()}
    org_jobs = max(2, math.floor(0.9 * sum(team_jobs.values())))
    reservation = RATE_CENTS * 10_000 * (MAX_RUNTIME_S + KILL_GRACE_S) / 3600
    hours = cfg.run_s / 3600 + 0.5

    def budget(jobs: int) -> int:  # 5x the most these jobs can reserve and spend in the run
        return int(5 * jobs * (reservation + RATE_CENTS * 10_000 * hours))

    common = {"max_wait_s": BUDGET_MAX_WAIT_S}
    rules = [BudgetRule(ORG, org_jobs * RATE_CENTS, budget(org_jobs), "month", **common)]
    rules += [
        BudgetRule(team, jobs * RATE_CENTS, budget(jobs), "week", **common)
        for team, jobs in team_jobs.items()
    ]
    rules += [
        BudgetRule(scope, SESSION_JOBS * RATE_CENTS, budget(SESSION_JOBS), "day", **common)
        for scope in cfg.scopes()
    ]
    return rules
