"""How a benchmark reports: progress lines on stderr, markdown tables on stdout."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence


def logger(name: str) -> Callable[[str], None]:
    """A function that prints `[name HH:MM:SS] message` to stderr at once."""

    def log(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, padded so it also reads as plain text."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def num(value: float | None, digits: int = 1, unit: str = "") -> str:
    """`value` with `digits` decimals and `unit`, or "-" when there is none."""
    return "-" if value is None else f"{value:.{digits}f}{unit}"
