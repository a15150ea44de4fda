"""A results table (a pandas frame) as text that fits the terminal, as the CLI's own tables do:
a description is cut to what is left first (never below `CUT_LEAST` characters), then columns
are left out in the order the caller gives (times and counts before money and state), and a
line below names them. The whole table stays in the sweep's trials.csv."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

CUT_LEAST = 20
"""The narrowest a cut description is shown."""


def _render(frame: Any) -> str:
    return frame.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def _cut(frame: Any, column: str, width: int) -> Any:
    """`frame` with `column` cut to what the other columns leave of `width` (at least
    `CUT_LEAST`), a cut cell ending in `…`."""
    others = _widest(_render(frame.drop(columns=[column])))
    room = max(CUT_LEAST, width - others - 2)
    cut = frame.copy()
    cut[column] = [
        str(v) if len(str(v)) <= room else str(v)[: room - 1] + "…" for v in frame[column]
    ]
    return cut


def fit_frame(
    frame: Any, width: int, drop_first: Sequence[str], cut: str | None = None
) -> tuple[str, str | None]:
    """`frame` as text of at most `width` columns where it can be, and the note naming the
    columns left out, wrapped to `width` (None when none is). `cut` names a description to cut
    before anything is left out; `drop_first` the columns to leave out, first to last, while
    the table is too wide."""
    shown, left_out = frame, []
    while True:
        fitted = _cut(shown, cut, width) if cut in shown and not shown.empty else shown
        text = _render(fitted)
        if _widest(text) <= width:
            break
        column = next((c for c in drop_first if c in shown), None)
        if column is None:
            break
        shown = shown.drop(columns=[column])
        left_out.append(column)
    if not left_out:
        return text, None
    note = f"not shown at {width} columns: {', '.join(left_out)} (all in trials.csv)"
    return text, textwrap.fill(note, width, break_on_hyphens=False)


def terminal_width() -> int:
    """The terminal's width (COLUMNS first), or what piped output is printed at."""
    import shutil

    from prefect_gpu_budget.settings import piped_columns

    return shutil.get_terminal_size((piped_columns(), 24)).columns
