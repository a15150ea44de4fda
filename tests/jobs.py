"""One way for tests to describe a job asking the ledger for admission."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect_gpu_budget.admission.ledger import NewJob

_DEFAULT = NewJob(
    scope="acme",
    name="j",
    instance_type="local:box",
    provisioning="on-demand",
    nodes=1,
    rate_micro_per_hour=3_600_000,
    rate_cents=360,
    priority=0,
    max_runtime_s=60.0,
    expected_runtime_s=None,
    holder="elsewhere:1:1",
)
"""$3.60 an hour for at most a minute, held by a process on another host."""


def new_job(scope: str, **changes: Any) -> NewJob:
    return replace(_DEFAULT, scope=scope, **changes)
