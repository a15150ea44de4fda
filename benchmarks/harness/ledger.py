"""A ledger for a benchmark run: the gate's tables dropped and recreated, so a run starts from
nothing whatever an earlier run left in the same database."""

from __future__ import annotations

from benchmarks.harness.parts import part
from prefect_gpu_budget.admission.ledger import Ledger, metadata


def fresh_ledger(url: str) -> Ledger:
    """The ledger at `url`, its gate tables dropped and created again (the rest of its database
    is left alone). The caller disposes of it."""
    old = Ledger(url, create=False)
    try:
        metadata.drop_all(part(old, "db").engine)
    finally:
        part(old, "db").dispose()
    return Ledger(url)
