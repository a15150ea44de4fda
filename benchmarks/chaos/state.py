"""What the runs share (`Setup`: the ledger, the limits, the fork server, what reconcile holds
open) and what one run found (`RunResult`)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos.config import PAUSE_S, PHASES
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.limits import RateLimits


@dataclass
class Setup:
    ledger: Ledger
    limits: RateLimits
    ctx: Any
    api_url: str
    prices: str
    rng: random.Random
    tag: str
    """Names this benchmark's orgs apart from any other on the same Prefect server."""
    awaiting: dict[str, str] = field(default_factory=dict)
    """Rows reconcile holds open until an unrecorded lease expires: job id -> org."""
    late: list[str] = field(default_factory=list)
    """Findings: Prefect still held slots when reconcile settled such a row."""
    late_cents: int = 0
    seen: dict[str, deque] = field(
        default_factory=lambda: {p: deque([2 * PAUSE_S], maxlen=50) for p in PHASES}
    )
    """Recent lengths of each phase in the workers that were not killed."""


@dataclass
class RunResult:
    org: str
    phase: str
    mark: str | None
    """The step mark the victim was killed at (None: at a random moment of `phase`)."""
    landed: str
    position: str
    """The victim's last step mark: `>acquire` killed in it, `<acquire` after it returned."""
    injected: bool
    delay_s: float
    reconciled: list[str]
    audit: Any
    second_settles_charged: int
    outlived: int
    errors: int
    stuck: int
    wall_s: float
    overshoot_micro: int = 0
    """Fault runs: real spend (rate x the tree's watched life) beyond the reservation."""
    unmetered_micro: int = 0
    """Fault runs: real spend beyond what was billed."""
    fault: str | None = None

    def lost(self) -> dict[str, int]:
        """This run's figures that are not zero among those that must be."""
        a = self.audit
        figures = {
            "orphans_left": a.orphans_left,
            "double_charges": a.double_charges,
            "missing_charges": a.missing_charges,
            "slot_mismatch_cents": a.slot_mismatch_cents,
            "invariant_violations": a.invariant_violations,
            "second_settles_charged": self.second_settles_charged,
            "jobs_outlived_holder": self.outlived,
            "worker_errors": self.errors,
            "stuck_workers": self.stuck,
            "overshoot_micro": self.overshoot_micro,
            "unmetered_micro": self.unmetered_micro,
        }
        return {k: v for k, v in figures.items() if v}
