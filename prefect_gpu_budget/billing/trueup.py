"""The rules that true the ledger up from a cloud's bill, pure (no I/O, no clock):

- whose a line is (`owner_of`): the ledger job its `gpu-budget-job` mark names; else, for a
  SageMaker line, the job whose training job its resource ARN names (the launcher records the
  training job's name); else nobody's: `untagged` if it bills usage, `account` if it bills the
  account (a tax, a fee, a credit or refund without a mark). Lines of nobody's are shown apart
  and never spread over scopes;
- when a job's figure is final (`is_final`): the job is settled and every line of it ended its
  usage at least the provisional window ago (the providers restate lines for a day or two);
  a provisional figure is shown and moves no budget;
- which billing periods a daily import reads (`periods_to_read`): the current one and, for
  15 days after its end, the last closed one (AWS restates a closed period for two weeks).

What a final figure changes in the budgets is `accounting.book_trueup`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from prefect_gpu_budget.billing.lines import BillLine

DEFAULT_PROVISIONAL_HOURS = 48.0
"""Lines whose usage ended less than this long ago are provisional (Kubecost waits ~48 h)."""
REREAD_CLOSED_DAYS = 15
"""For this long after a billing period ends, the daily import reads it again."""
LINE_KINDS: tuple[str, ...] = ("job", "untagged", "account")


@dataclass(frozen=True)
class BilledJob:
    """What the true-up needs of a ledger job."""

    id: str
    org: str
    scope: str
    state: str
    launcher: str
    external_id: str | None
    reserved_micro: int
    actual_micro: int | None
    started_at: float | None
    ended_at: float | None
    settled_at: float | None


def resource_name(resource_id: str | None) -> str | None:
    """The last part of a resource's id (`arn:...:training-job/NAME` -> `NAME`)."""
    if not resource_id:
        return None
    return resource_id.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1] or None


def owner_of(
    line: BillLine,
    by_id: Mapping[str, BilledJob],
    by_external: Mapping[str, BilledJob],
) -> tuple[str, BilledJob | None]:
    """(kind, job) of a line: `job` and the job it bills, or `untagged` / `account` and None.
    `by_external` holds the jobs by their launcher's external id (a training job's name)."""
    if line.job_mark and line.job_mark in by_id:
        return "job", by_id[line.job_mark]
    name = resource_name(line.resource_id)
    if name and name in by_external:
        return "job", by_external[name]
    return ("untagged" if line.usage else "account"), None


def is_final(
    job: BilledJob, usage_ends: Iterable[float], now: float, provisional_hours: float
) -> bool:
    """Whether the bill's figure for `job` is final: the job is settled and no line of it
    ended its usage less than `provisional_hours` before `now` (0: every line is final)."""
    if job.state != "settled":
        return False
    cutoff = now - provisional_hours * 3600
    return all(end <= cutoff for end in usage_ends)


def month_of(t: float) -> str:
    """The billing period (UTC month, `YYYY-MM`) holding the instant `t`."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m")


def periods_to_read(now: float) -> list[str]:
    """The billing periods a daily import reads at `now`: the current one, and the last one
    until REREAD_CLOSED_DAYS after it closed."""
    this = datetime.fromtimestamp(now, timezone.utc).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    last = (this - timedelta(days=1)).strftime("%Y-%m")
    if now < (this + timedelta(days=REREAD_CLOSED_DAYS)).timestamp():
        return [last, this.strftime("%Y-%m")]
    return [this.strftime("%Y-%m")]
