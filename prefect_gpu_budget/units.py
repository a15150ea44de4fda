"""Money, durations and scopes: the value types every other module speaks.

Money is kept as integer micro-dollars (``1 USD == 1_000_000``) from the price catalog to the
ledger, so sums over millions of settlements are exact. Rates for the hourly cap are integer
cents per hour (the unit of the Prefect concurrency limits), rounded up so that the cap is never
under-counted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from functools import lru_cache

MICRO_PER_USD = 1_000_000
MICRO_PER_CENT = 10_000
MAX_USD = Decimal(10) ** 9
"""Largest amount accepted anywhere (a billion dollars): keeps every sum inside 64-bit integers."""
MAX_DURATION_S = 30 * 24 * 3600
AGENT_MAX_QUEUED = 16
"""Jobs an agent session may have queued at once unless its team's `AgentLimits` say."""


def shown(value: object, limit: int = 60) -> str:
    """A value as an error message quotes it: repr, cut short so hostile input stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_URL_CREDENTIALS_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s'\"<>]*@")


def redact_urls(text: str) -> str:
    """`text` with the credentials of every URL in it (all between `://` and the URL's LAST
    `@`, so a password with an unencoded `@` goes whole) written as `***`."""
    return _URL_CREDENTIALS_RE.sub(r"\1***@", text)


def url_credentials(text: str) -> list[str]:
    """The credentials (`user:password`) of every URL in `text`: what `redact_urls` hides."""
    return [m.group(0)[len(m.group(1)) : -1] for m in _URL_CREDENTIALS_RE.finditer(text)]


class BudgetInputError(ValueError):
    """Bad input from a user: its message is one line naming the field and the rule."""

    def __init__(self, field: str, rule: str) -> None:
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}")


def to_decimal_usd(value: object, field: str) -> Decimal:
    """Parse a USD amount (str, int, Decimal or float) and check it is finite, >= 0, sane."""
    if isinstance(value, bool):
        raise BudgetInputError(field, "must be a number of US dollars")
    try:
        amount = Decimal(str(value).strip().lstrip("$")) if value is not None else None
    except (InvalidOperation, ValueError):
        amount = None
    if amount is None:
        raise BudgetInputError(field, f"must be a number of US dollars, got {shown(value)}")
    if not amount.is_finite():
        raise BudgetInputError(field, "must be a finite amount (no NaN or infinity)")
    if amount < 0:
        raise BudgetInputError(field, f"must not be negative, got {amount}")
    if amount > MAX_USD:
        raise BudgetInputError(field, f"must be at most {MAX_USD:,} USD, got {amount:,}")
    return amount


def usd_to_micro(amount: Decimal) -> int:
    """Exact for amounts with up to six decimals; finer fractions round up (never under-count)."""
    return math.ceil(amount * MICRO_PER_USD)


def micro_to_usd(micro: int) -> float:
    """For JSON output only: the shortest float that prints as the exact six-decimal amount."""
    return float(Decimal(micro) / MICRO_PER_USD)


def usd(micro: int | None) -> float | None:
    """Micro-dollars as US dollars for a JSON answer; None stays None."""
    return None if micro is None else micro_to_usd(micro)


def iso(t: float | None) -> str | None:
    """An epoch time as ISO 8601 in UTC, as every JSON answer writes times; None stays None."""
    from datetime import datetime, timezone

    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()


def fmt_usd(micro: int) -> str:
    """`$12.34` from a dollar up; below it four significant digits, so that small jobs show
    (`$0.0085`, `$0.1235`, `$0.50`); a negative figure with its sign first (`-$0.00215`)."""
    if micro < 0:
        return "-" + fmt_usd(-micro)
    usd = Decimal(micro) / MICRO_PER_USD
    if abs(micro) >= MICRO_PER_USD or micro == 0:
        return f"${usd:,.2f}"
    digits = min(6, 3 - usd.copy_abs().adjusted())  # a micro-dollar is the ledger's unit
    whole, _, frac = f"{usd:.{digits}f}".rstrip("0").partition(".")
    return f"${whole}.{frac.ljust(2, '0')}"


def rate_cents(rate_micro_per_hour: int) -> int:
    """Concurrency-limit slots for a rate: whole cents per hour, rounded up, at least one."""
    return max(1, -(-rate_micro_per_hour // MICRO_PER_CENT))


MAX_CAP_CENTS = 2**31 - 1
"""Largest hourly cap, in cents per hour: a Prefect concurrency limit on a PostgreSQL-backed
server is a 32-bit integer."""
MAX_CAP_RULE = (
    f"must be at most ${Decimal(MAX_CAP_CENTS) / 100:,}/h, the largest hourly cap a Prefect "
    "concurrency limit can hold (2^31 - 1 cents per hour)"
)


def cap_cents(cap_micro_per_hour: int) -> int:
    """Concurrency-limit slots for an hourly cap: whole cents per hour, rounded DOWN (a cap is
    never over-counted: $0/h admits nothing, $0.019/h admits a $0.01/h job)."""
    return cap_micro_per_hour // MICRO_PER_CENT


def cost_micro(rate_micro_per_hour: int, seconds: float, *, round_up: bool) -> int:
    """Cost of running at a rate for some seconds, in micro-dollars.

    Reservations round up (``round_up=True``) so a hold is never smaller than the worst case;
    settlements round half up to the nearest micro-dollar.
    """
    micro_seconds = round(seconds * 1_000_000)
    numerator = rate_micro_per_hour * micro_seconds
    denominator = 3600 * 1_000_000
    if round_up:
        return -(-numerator // denominator)
    return (2 * numerator + denominator) // (2 * denominator)


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|m|s)")
_DURATION_FULL_RE = re.compile(r"^\s*(?:\d+(?:\.\d+)?\s*[dhms]\s*)+$")
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_SLURM_RE = re.compile(
    r"^\s*(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+))?(?::(?P<ds>\d+))?"
    r"|(?P<a>\d+):(?P<b>\d+)(?::(?P<c>\d+))?)\s*$"
)
"""Slurm's time limits: `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S` (a bare number stays
seconds here, where Slurm reads minutes)."""


def _slurm_seconds(found: re.Match[str]) -> float:
    if found["d"] is not None:  # days-hours[:minutes[:seconds]]
        parts = (found["d"], found["dh"], found["dm"], found["ds"])
    elif found["c"] is None:  # minutes:seconds
        parts = (None, None, found["a"], found["b"])
    else:  # hours:minutes:seconds
        parts = (None, found["a"], found["b"], found["c"])
    return float(sum(int(n or 0) * u for n, u in zip(parts, (86400, 3600, 60, 1), strict=True)))


def parse_duration(value: object, field: str, *, allow_zero: bool = False) -> float:
    """Seconds from `90`, `"90s"`, `"1h30m"`, `"2d"`, Slurm's `"1:30:00"` or `"2-00:00:00"`,
    or a timedelta; anything else is an error."""
    if isinstance(value, bool) or value is None:
        raise BudgetInputError(
            field, f"must be a duration such as '2h' or '90m', got {shown(value)}"
        )
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif (
        isinstance(value, (int, float))
        or isinstance(value, str)
        and re.fullmatch(r"\s*\d+(\.\d+)?\s*", value)
    ):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION_FULL_RE.fullmatch(value.lower()):
        seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_RE.findall(value.lower()))
    elif isinstance(value, str) and (slurm := _SLURM_RE.fullmatch(value)):
        seconds = _slurm_seconds(slurm)
    else:
        raise BudgetInputError(
            field,
            "must be a duration such as '2h', '90m', '1h30m' (units d h m s) or Slurm's "
            f"'1:30:00' or '2-00:00:00', got {shown(value)}",
        )
    if not math.isfinite(seconds):
        raise BudgetInputError(field, "must be a finite duration")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise BudgetInputError(
            field, f"must be {'>= 0' if allow_zero else '> 0'}, got {shown(value)}"
        )
    if seconds > MAX_DURATION_S:
        raise BudgetInputError(field, f"must be at most 30 days, got {shown(value)}")
    return seconds


def fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts)


SEGMENT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
MAX_SCOPE_DEPTH = 3


def validate_scope(value: object, field: str = "scope") -> str:
    """A scope is `org`, `org/team` or `org/team/session`.

    Segments are lower-case ASCII letters, digits, `-` and `_` (at most 48, starting with a
    letter or digit), so scopes cannot smuggle path tricks or unicode look-alikes, and two
    different scopes never map to the same concurrency-limit name.
    """
    if not isinstance(value, str):
        raise BudgetInputError(
            field, f"must be a string like 'org/team/session', got {shown(value)}"
        )
    segments = value.split("/")
    if not value or len(segments) > MAX_SCOPE_DEPTH:
        raise BudgetInputError(
            field,
            f"must have 1 to {MAX_SCOPE_DEPTH} segments like 'org/team/session', got {shown(value)}",
        )
    for segment in segments:
        if not SEGMENT_RE.fullmatch(segment):
            raise BudgetInputError(
                field,
                "segments must be 1-48 of a-z 0-9 - _ starting with a letter or digit, "
                f"got {shown(value)}",
            )
    return value


@lru_cache(maxsize=1 << 14)
def narrowing_refusal(scope: str, outer: str | None, whose: str) -> str:
    """Why `scope` may not stand in for `outer` ("" if it may): a run may narrow the scope it
    was given (to `outer` itself or a sub-scope of it), never move elsewhere. `whose` names
    the outer scope in the reason, e.g. "the deployment's"."""
    if outer is None or scope == outer or scope.startswith(outer + "/"):
        return ""
    return f"scope {scope!r} is not within {whose} scope {outer!r}"


@lru_cache(maxsize=1 << 14)
def scope_path(scope: str) -> tuple[str, ...]:
    """`a/b/c` -> `('a', 'a/b', 'a/b/c')` (the scopes whose budgets a job must fit; cached: the
    ledger asks it of every queued job in each decision)."""
    segments = scope.split("/")
    return tuple("/".join(segments[: i + 1]) for i in range(len(segments)))


def org_of(scope: str) -> str:
    """The org a scope belongs to, its first segment: `acme/vision/agent-7` -> `acme`."""
    return scope.split("/", 1)[0]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest one-character inserts, deletes or changes from a to b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def near(value: str, known: Iterable[str], most: int = 2) -> list[str]:
    """The known names within `most` edits of `value`, closest first: what "did you mean"
    offers."""
    found = sorted((edit_distance(value, k), k) for k in set(known) if k != value)
    return [k for d, k in found if d <= most]
