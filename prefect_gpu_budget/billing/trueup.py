"""The rules that true the ledger up from a cloud's bill, pure (no I/O, no clock):

- whose a line is (`owner_of`): the ledger job its `gpu-budget-job` mark names; else, for a
  SageMaker line, the job whose training job its resource ARN names (the launcher records the
  training job's name); else nobody's: `untagged` if it bills usage, `account` if it bills the
  account (a tax, a fee, a credit or refund without a mark). Lines of nobody's are shown apart
  and never spread over scopes;
- whether a line can be true of the job it names (`refusal`): the job ran on the cloud whose
  bill it is (`job_cloud`), and the line's usage lies within the job's run, give or take
  `SLACK_S`; and, for a negative line (`booked_lines`), that it is a credit, refund or discount
  of a job with usage on the same bill, and leaves the job's bill at zero or more. A line
  refused is shown apart with its reason and moves nothing;
- when a job's figure is final (`provisional_reason`): the job is settled and every line of it
  ended its usage at least the provisional window ago (the providers restate lines for a day or
  two); a provisional figure is shown and moves no budget;
- when a final figure waits for an admin (`held_reason`): past `HOLD_MULTIPLE` times the
  larger of the job's reservation and its settlement, unless an admin accepted that much;
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


SLACK_S = 3600.0
"""How far a line's usage may reach outside its job's run (from its start to its end): both
clouds bill usage in lines of an hour, and the hour a job starts or ends in is its line's."""
HOLD_MULTIPLE = 2.0
"""A final figure past this many times the larger of the job's reservation (the worst case
the gate held for it) and its settlement is held for an admin to accept (`bill accept`)."""
SOURCE_CLOUD = {"aws-cur2": "aws", "gcp-billing": "gcp"}
"""The cloud whose bill each source is."""
WORKER_CLOUD = {
    "gpu-budget-vertex-ai": "gcp",
    "vertex-ai": "gcp",
    "cloud-run": "gcp",
    "cloud-run-v2": "gcp",
    "cloud-run-push": "gcp",
    "ecs": "aws",
    "ecs-push": "aws",
    "gpu-budget-process": None,
    "process": None,
    "docker": None,
}
"""The cloud a Prefect work pool's type runs its flow runs on (None: the worker's own host);
a type not named (kubernetes, ...) runs wherever the job's machine is priced."""
MACHINE_CLOUD = {"aws": "aws", "sagemaker": "aws", "gcp": "gcp"}
"""The cloud of a priced machine (`instance_type`'s prefix); `local:` machines have none."""
CREDIT_WORDS = ("credit", "refund", "discount", "negation", "regular", "adjustment")
"""A negative line is booked only if its type names one of these: AWS's Credit, Refund,
EdpDiscount, BundledDiscount, PrivateRateDiscount, SavingsPlanNegation ...; GCP's regular
rows (their cost plus credits) and adjustments. A negative Usage, Tax or Fee line is not."""


@dataclass(frozen=True)
class BilledJob:
    """What the true-up needs of a ledger job."""

    id: str
    org: str
    scope: str
    state: str
    launcher: str
    instance_type: str
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
    ended its usage less than `provisional_hours` before `now` (0: every line whose usage has
    ended is final)."""
    return provisional_reason(job, usage_ends, now, provisional_hours) is None


def provisional_reason(
    job: BilledJob, usage_ends: Iterable[float], now: float, provisional_hours: float
) -> str | None:
    """Why the bill's figure for `job` is not final yet (None: it is): the job has not
    settled, a line's usage has not ended by `now`, or it ended less than `provisional_hours`
    ago (the providers restate a line for a day or two)."""
    if job.state != "settled":
        return f"the job is {job.state}, not settled"
    last = max(usage_ends, default=float("-inf"))
    if last > now:
        return "usage not ended"
    if last > now - provisional_hours * 3600:
        return f"usage ended less than {provisional_hours:g} h ago"
    return None


def job_cloud(job: BilledJob) -> str | None:
    """The cloud that bills `job` (`aws`, `gcp`), or None: a local process (the local and the
    task launchers, a gated process worker), never on a cloud's bill. SageMaker jobs are AWS's,
    Vertex AI jobs GCP's; a worker's run is on its work pool type's cloud; a deployment's run
    (whose pool the ledger does not record) on the cloud of the machine it was priced as."""
    kind, _, rest = job.launcher.partition(":")
    machine = MACHINE_CLOUD.get(job.instance_type.partition(":")[0])
    if kind == "sagemaker":
        return "aws"
    if kind == "vertex":
        return "gcp"
    if kind == "worker" and rest in WORKER_CLOUD:
        return WORKER_CLOUD[rest]
    if kind in ("worker", "deployment"):
        return machine
    return None


def refusal(line: BillLine, job: BilledJob, now: float) -> str | None:
    """Why `line` cannot bill `job`, in a few words (None: it can): the job never ran on the
    cloud whose bill the line is on, never started, or ran outside the line's usage (give or
    take `SLACK_S`), or the line's resource is another SageMaker training job than the job's."""
    cloud, bill = job_cloud(job), SOURCE_CLOUD.get(line.source)
    if cloud is None:
        return f"job {job.id} ran on {job.instance_type} ({job.launcher}): no cloud bills it"
    if cloud != bill:
        return f"job {job.id} ran on {cloud.upper()}, not on this {line.source} bill's cloud"
    if job.started_at is None:
        return f"job {job.id} never started"
    end = job.ended_at if job.ended_at is not None else now
    if line.usage_start < job.started_at - SLACK_S or line.usage_end > end + SLACK_S:
        return (
            f"usage {_stamp(line.usage_start)}-{_stamp(line.usage_end)} outside job "
            f"{job.id}'s run {_stamp(job.started_at)}-{_stamp(end)} (+/- {SLACK_S / 3600:g} h)"
        )
    name = resource_name(line.resource_id)
    if (
        name
        and job.external_id
        and job.launcher.startswith("sagemaker")
        and ":training-job/" in (line.resource_id or "")
        and name != job.external_id
    ):
        return f"its resource is training job {name}, not job {job.id}'s {job.external_id}"
    return None


def booked_lines(
    lines: Iterable[BillLine], other_micro: int = 0, other_usage: bool = False
) -> tuple[list[BillLine], list[tuple[BillLine, str]]]:
    """Of one job's lines on one bill (each already found true of it), (booked, refused with
    the reason): every line of zero or more; a negative line only if its type is a credit, a
    refund or a discount (`CREDIT_WORDS`), the job has usage on the same bill (here, or
    `other_usage` in its other periods), and it leaves the job's bill (with `other_micro`, what
    its other periods book) at zero or more. Negative lines are taken by usage start, then
    id."""
    booked: list[BillLine] = []
    refused: list[tuple[BillLine, str]] = []
    total = other_micro
    negative = []
    for line in lines:
        if line.billed_micro >= 0:
            booked.append(line)
            total += line.billed_micro
        else:
            negative.append(line)
    has_usage = other_usage or any(ln.usage and ln.billed_micro > 0 for ln in booked)
    for line in sorted(negative, key=lambda ln: (ln.usage_start, ln.line_id)):
        kind = line.line_type.lower()
        if not any(word in kind for word in CREDIT_WORDS):
            refused.append((line, f"a negative {line.line_type} line is no credit or refund"))
        elif not has_usage:
            refused.append((line, "a credit for a job with no usage on this bill"))
        elif total + line.billed_micro < 0:
            refused.append((line, "it would take the job's bill below zero"))
        else:
            booked.append(line)
            total += line.billed_micro
    return booked, refused


def held_reason(job: BilledJob, billed_micro: int, accepted_micro: int | None) -> str | None:
    """Why a final figure waits for an admin (None: it books): it is past `HOLD_MULTIPLE`
    times the larger of the job's reservation and its settlement, and above what an admin
    accepted for the job (`accepted_micro`)."""
    base = max(job.reserved_micro or 0, job.actual_micro or 0)
    if billed_micro <= HOLD_MULTIPLE * base:
        return None
    if accepted_micro is not None and billed_micro <= accepted_micro:
        return None
    return f"billed past {HOLD_MULTIPLE:g} x its reservation or settlement: `bill accept {job.id}`"


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


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
