"""A queued job as the admission decision sees it (`Request`): what `policy` decides over,
what `queueing` orders, and what the ledger and the simulator build from a job's row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect_gpu_budget.admission.rules.quota import Shape


@dataclass(frozen=True)
class Request:
    """A queued job as the decision sees it."""

    job_id: str
    scope: str
    rate_micro_per_hour: int
    rate_cents: int
    max_runtime_s: float
    expected_runtime_s: float | None
    priority: int
    requested_at: float
    on_limit: str | None = None
    """The job's own `queue`/`reject` choice; None follows the deepest budget on its path."""
    max_wait_s: float | None = None
    """The job's own max wait (0 = forever); None follows the deepest budget on its path."""
    shape: Shape | None = None
    """What it occupies in a capacity pool, if it runs in one."""

    @classmethod
    def of(cls, job_id: str, job: Any, requested_at: float, shape: Shape | None = None) -> Request:
        """The request of a job whose fields go by these names: its row, or the `NewJob` the
        ledger records."""
        return cls(
            job_id=job_id,
            scope=job.scope,
            rate_micro_per_hour=job.rate_micro_per_hour,
            rate_cents=job.rate_cents,
            max_runtime_s=job.max_runtime_s,
            expected_runtime_s=job.expected_runtime_s,
            priority=job.priority,
            requested_at=requested_at,
            on_limit=job.on_limit,
            max_wait_s=job.max_wait_s,
            shape=shape,
        )
