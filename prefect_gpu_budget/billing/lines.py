"""One line of a cloud's bill, as every reader hands it on (`BillLine`), its money in integer
micro-dollars, a read of an export line by line (`BillRead`), and the one-line error a bad
export gets (`BillError`). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from prefect_gpu_budget.units import MICRO_PER_USD, BudgetInputError

SOURCES: tuple[str, ...] = ("aws-cur2", "gcp-billing")
"""The exports a bill is read from: AWS Cost and Usage Report 2.0, GCP's billing export."""
JOB_MARK = "gpu-budget-job"
"""The tag (SageMaker) or label (Vertex AI) every cloud job carries: its ledger job id."""


class BillError(BudgetInputError):
    """A bill that cannot be read: one line naming the file, the column and the row (row 1 is
    the first line of data), whatever is known of them. Bad input: the CLI exits 2 with it."""

    def __init__(
        self, where: str, rule: str, column: str | None = None, row: int | None = None
    ) -> None:
        at = "".join(
            (f", column {column}" if column else "", f", row {row}" if row is not None else "")
        )
        super().__init__(f"{where}{at}", rule)
        self.where, self.column, self.row = where, column, row


@dataclass(frozen=True)
class BillLine:
    """One line of a cloud's bill, whatever the export it came from."""

    source: str
    """Which export: one of SOURCES."""
    billing_period: str
    """The month it is billed in, `YYYY-MM` (AWS's billing period, GCP's invoice month)."""
    line_id: str
    """Its identity on its cloud's bill, the same whatever file, copy, delivery or billing
    period it is read from (AWS: `identity_line_item_id` and `identity_time_interval`; GCP,
    which has none: a digest of the fields that name a usage line, `gcp_billing`'s docstring).
    Rows of one read that share an identity but differ (in amount, usage, type, mark, resource,
    `version`) are numbered `#2`, `#3`...; rows alike in all of them are one line read twice."""
    line_type: str
    """The export's own word for it: AWS's `line_item_line_item_type` (Usage, Credit, Tax,
    Fee, Refund, DiscountedUsage, SavingsPlanCoveredUsage ...), GCP's `cost_type` (regular,
    tax, adjustment, rounding error)."""
    usage_start: float
    """When the usage it bills began and ended (epoch seconds)."""
    usage_end: float
    billed_micro: int
    """What it bills, in micro-dollars (negative for a credit or a refund): AWS's net
    unblended cost where the export has it, else its unblended cost; GCP's `cost` plus the sum
    of its `credits.amount`."""
    currency: str
    job_mark: str | None = None
    """The value of its `gpu-budget-job` tag or label: the ledger job it bills, if marked."""
    resource_id: str | None = None
    """AWS's `line_item_resource_id` (a SageMaker training job's ARN), GCP's
    `resource.global_name`: how a line without a mark may still be matched."""
    description: str = ""
    """What it is, for people: AWS's usage type, GCP's SKU description."""
    where: str = ""
    """The file (and row) it was read from, for the messages about it."""
    version: str = ""
    """What tells two rows of one identity apart besides their money (GCP: `export_time`: a
    row appended later for the same usage is another row, while a copy keeps the time)."""

    @property
    def content(self) -> tuple[object, ...]:
        """All of it that matters but where it was read from: two lines alike in it are one
        line read twice (a copy of a file, a re-download, a re-delivery)."""
        return (
            self.source,
            self.line_id,
            self.line_type,
            self.usage_start,
            self.usage_end,
            self.billed_micro,
            self.currency.upper(),
            self.job_mark,
            self.resource_id,
            self.description,
            self.version,
        )

    @property
    def usage(self) -> bool:
        """Whether it bills usage (so, unmarked, it is untagged spend) rather than the account
        (a tax, a fee, a credit or a refund of the whole account)."""
        return self.line_type.lower() in USAGE_TYPES


@dataclass(frozen=True)
class BillRead:
    """One read of an export, line by line: `lines` is consumed once, lazily (a month of a
    cloud's bill may hold tens of millions of lines), and its lines are not yet numbered: a
    line id repeated within one read is numbered by whoever imports it, as
    `reading.number_repeats` numbers a list."""

    lines: Iterable[BillLine]
    periods: tuple[tuple[str, str], ...] = ()
    """The (source, billing period)s it imports even if no line of them is read (an empty
    delivery replaces what an earlier one billed)."""


USAGE_TYPES = frozenset(
    t.lower()
    for t in (
        "Usage",
        "DiscountedUsage",
        "SavingsPlanCoveredUsage",
        "SavingsPlanNegation",
        "regular",
    )
)
"""The line types that bill usage; the rest (Tax, Fee, Credit, Refund, RIFee, EdpDiscount,
BundledDiscount, SavingsPlanRecurringFee ..., GCP's tax, adjustment, rounding error) bill the
account unless a mark ties them to a job."""


def to_micro(value: object, where: str, column: str, row: int | None) -> int:
    """A money figure of an export (a number, or a number's text) in micro-dollars, rounded
    half up; `BillError` naming the column and row for anything else (None and NaN too)."""
    amount = to_decimal(value, where, column, row)
    return int((amount * MICRO_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def to_decimal(value: object, where: str, column: str, row: int | None) -> Decimal:
    """A money figure of an export (a number, or a number's text) as the exact decimal it
    says; `BillError` naming the column and row for anything else (None and NaN too)."""
    if isinstance(value, bool):
        raise BillError(where, f"not an amount of money: {value!r}", column, row)
    try:
        amount = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise BillError(
            where, f"not an amount of money: {str(value)[:40]!r}", column, row
        ) from None
    if not amount.is_finite() or abs(amount) >= Decimal(10) ** 9:
        raise BillError(where, f"not an amount of money: {str(value)[:40]!r}", column, row)
    return amount
