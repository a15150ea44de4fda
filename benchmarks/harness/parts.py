"""The benchmarks drive whichever tree they run against (`--before`), whatever the shape of its
objects: a ledger of stores (`ledger.queue`, `ledger.config`, `ledger.db`, ... since
2026-12-04) or an earlier one object with every method on it, and a gate whose admitted jobs
are settled through `gate.holding` or by the gate itself."""

from __future__ import annotations

from typing import Any


def part(obj: Any, name: str) -> Any:
    """`obj`'s part `name` (`part(ledger, "config").set_budget(...)`), or `obj` itself in a
    tree from before the part existed."""
    return getattr(obj, name, obj)
