"""Every table of the CLI fits the terminal's width.

What gives way first: descriptions (reasons, sources, periods) wrap and fold down to
`TEXT_LEAST` columns; then names wrap at their spaces, never inside a word; then two figures
shown as one (`$7.20 / $100.00`) wrap at their ` / `; then headers wrap at their spaces. Scopes,
ids and money are never cut. A table that still does not fit leaves out whole columns, the least
important first (times, descriptions and ids before money, scopes never), and says below itself
which.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prefect_gpu_budget.cli.common import console

Kind = Literal["key", "name", "pair", "text"]

TEXT_LEAST = 10
"""The narrowest a description column is wrapped to."""

_SHRINK_ORDER: tuple[Kind, ...] = ("text", "name", "pair", "key")


@dataclass(frozen=True)
class Col:
    """One column of a table.

    kind: "key" for scopes, ids, money and counts (shown whole, on one line: only the header may
    wrap at its spaces), "name" for other names (wrapped only at their spaces), "pair" for two
    figures as one (`$765.31 / $2,000.00`: wrapped only at their spaces, after names), "text"
    for descriptions (wrapped, long words folded).
    drop: 0 for a column that is always shown; columns that cannot fit are left out from the
    highest drop down, and a lower-ranked one that fits in what is left is still shown.
    """

    header: str
    kind: Kind = "key"
    drop: int = 0


def _overhead(columns: int) -> int:
    """What rich's default table adds to its cells: two edges, a rule between columns and one
    space of padding either side of every cell."""
    return 3 * columns + 1


def _longest_word(text: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(word) for word in text.split()), default=0)


def layout(columns: Sequence[Col], rows: Sequence[Sequence[str]], width: int) -> dict[int, int]:
    """The columns to show (by index, in order) and the width of each, for `width` columns."""
    from rich.cells import cell_len

    natural: list[int] = []
    least: list[int] = []
    for i, col in enumerate(columns):
        cells = [row[i] for row in rows]
        widest = max((cell_len(c) for c in cells), default=0)
        natural.append(max(widest, cell_len(col.header)))
        words = max(_longest_word(col.header), 1)
        if col.kind == "key":
            least.append(max(widest, words))
        elif col.kind in ("name", "pair"):
            least.append(max(max((_longest_word(c) for c in cells), default=0), words))
        else:
            least.append(min(natural[i], TEXT_LEAST))

    def fits(shown: list[int]) -> bool:
        return _overhead(len(shown)) + sum(least[i] for i in shown) <= width

    shown = [i for i, col in enumerate(columns) if not col.drop]
    # a column with nothing in it is the least important of all
    by_importance = sorted(
        (i for i, col in enumerate(columns) if col.drop),
        key=lambda i: (not any(row[i] for row in rows), columns[i].drop),
    )
    for i in by_importance:
        if fits([*shown, i]):
            shown.append(i)
    shown.sort()
    widths = {i: natural[i] for i in shown}
    excess = _overhead(len(shown)) + sum(widths.values()) - width
    for kind in _SHRINK_ORDER:
        while excess > 0:
            give = [i for i in shown if columns[i].kind == kind and widths[i] > least[i]]
            if not give:
                break
            widest = max(give, key=lambda i: widths[i])
            widths[widest] -= 1
            excess -= 1
    return widths


def fit_table(
    columns: Sequence[Col], rows: Iterable[Sequence[str]], width: int
) -> tuple[Any, str | None]:
    """A rich table of `rows` under `columns` that fits `width` columns where it can (a table
    of columns that are never left out, each wider than the terminal, cannot), and the line
    that names the columns left out (None when none is)."""
    from rich.table import Table
    from rich.text import Text

    rows = [[str(cell) for cell in row] for row in rows]
    widths = layout(columns, rows, width)
    table = Table()
    for i, w in widths.items():
        table.add_column(columns[i].header, width=w, overflow="fold")
    for row in rows:
        table.add_row(*(Text(row[i]) for i in widths))  # cells are data, never rich markup
    left_out = [col.header for i, col in enumerate(columns) if i not in widths]
    return table, f"not shown at {width} columns: {', '.join(left_out)}" if left_out else None


def print_table(columns: Sequence[Col], rows: Iterable[Sequence[str]]) -> None:
    """Print a table that fits the console's width, and which columns it leaves out."""
    table, note = fit_table(columns, rows, console.rich().width)
    console.print(table)
    if note:
        console.print(note, markup=False, highlight=False)


def resources(r: tuple[int, int, int], model: str = "") -> str:
    return f"{r[0]} {model} / {r[1]} vCPU / {r[2]} GiB".replace("  ", " ")


_POOL_COLUMNS = (
    Col("team"),
    Col("quota", "name"),
    Col("used", "name"),
    Col("borrowed", drop=1),
    Col("lent", drop=2),
    Col("borrow / lend / weight", "name", drop=3),
    Col("reclaim / within team / queue", "name", drop=4),
)


def print_pool(pool: dict) -> None:
    rows = [
        (
            t["team"],
            resources(t["quota"], pool["gpu_model"]),
            resources(t["used"]),
            str(t["borrowed"][0]),
            str(t["lent"][0]),
            f"{t['borrow_pct']}% / {t['lend_pct']}% / {t['weight']}",
            f"{t['reclaim']} / {t['within_team']} / {t['queueing']}",
        )
        for t in pool["teams"]
    ]
    console.print(
        f"pool {pool['org']}/{pool['pool']} ({pool['kind']}, {pool['nodes']} x "
        f"{resources(pool['node'], pool['gpu_model'])}): {pool['used'][0]} of {pool['total'][0]} "
        "accelerators in use"
    )
    if rows:
        print_table(_POOL_COLUMNS, rows)
    for q in pool["queue"]:
        console.print(f"[yellow]queued[/] {q['job_id'][:8]} {q['scope']}: {q['reason']}")
