"""What counts as a dependency being down, how to say so in one line, and how to wait it out.

The one retry mechanism of the gate and the watcher: a call is retried while the ledger's
database or the Prefect API is down, with a clear message every `TELL_EVERY_S`, and a bad request
is never retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa

from prefect_gpu_budget.admission.limits import DependencyDown
from prefect_gpu_budget.units import redact_urls

OUTAGES = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError, DependencyDown)
"""A dependency that is down or restarting (or every connection of the process's pool busy for
longer than its timeout), as opposed to a bad request."""

TELL_EVERY_S = 10.0
"""How often a caller that keeps retrying says so."""

T = TypeVar("T")


def describe(exc: BaseException) -> str:
    """One line naming what is down, without connection strings (they may hold credentials)."""
    if isinstance(exc, DependencyDown):
        return redact_urls(str(exc))
    orig = getattr(exc, "orig", None) or exc
    text = redact_urls(str(orig).strip().splitlines()[0]) if str(orig).strip() else ""
    return f"the ledger's database is unreachable ({type(orig).__name__}: {text[:160]})"


def patiently(
    what: str,
    call: Callable[[], T],
    warn: Callable[[str], None],
    patience: float | Callable[[], float | None] | None = None,
) -> T:
    """`call()`, retried while a dependency is down, telling `warn` every `TELL_EVERY_S` and
    once it is back; after `patience` seconds of outage the error is raised (a callable
    `patience` is asked only once an outage begins)."""
    delay, down_since, told = 0.2, None, 0.0
    while True:
        try:
            result = call()
        except OUTAGES as exc:
            now = time.monotonic()
            down_since = down_since or now
            if callable(patience):
                patience = patience()
            if patience is not None and now - down_since > patience:
                raise
            if now - told >= TELL_EVERY_S:
                told = now
                warn(
                    f"{what}: {describe(exc)}; retrying until it is back "
                    f"(down {now - down_since:.0f}s)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if down_since is not None:
            warn(f"{what}: back after {time.monotonic() - down_since:.1f}s")
        return result
