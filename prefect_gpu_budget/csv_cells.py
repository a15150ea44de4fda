"""Tables written as CSV for people to open in a spreadsheet: no cell is read as a formula.

A sweep's grid values and metric names are an agent's words; a cell starting with `=`, `+`,
`-`, `@`, a tab or a carriage return is a formula to Excel, LibreOffice and Google Sheets
(CSV injection). As OWASP describes, such a text cell (header included) is written with a
single quote before it; numbers are written as numbers (`-0.5` stays a number).
"""

from __future__ import annotations

import io
from typing import Any

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet reads as the start of a formula."""


def safe_cell(value: Any) -> Any:
    """`value`, with a single quote before it when it is text a spreadsheet would run."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def to_csv(frame: Any, path: Any = None) -> str | None:
    """`frame` (a pandas DataFrame) as CSV, every text cell and header made safe
    (`safe_cell`): written to `path`, or returned when there is none."""
    from pandas.api.types import is_numeric_dtype

    safe = frame.rename(columns=lambda c: safe_cell(str(c)))
    for column in safe.columns:
        if not is_numeric_dtype(safe[column]):  # text, or mixed: each text cell made safe
            safe[column] = safe[column].map(safe_cell)
    if path is not None:
        safe.to_csv(path, index=False)
        return None
    buffer = io.StringIO()
    safe.to_csv(buffer, index=False)
    return buffer.getvalue()
