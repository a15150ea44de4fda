"""The dated price catalog and its lookup.

Rows ship in `catalog.csv` beside this module; `local:<name>` rows are priced by the admin in
the ledger (`prices set-local`), so every host and replica on one ledger reads one list; the
side that has the ledger reads them and hands them in (`admission.prices`): nothing here reads
the ledger. A CSV of the same columns is an import and an export (`prices import-local`,
`export-local`), read besides only where `PREFECT_GPU_BUDGET_PRICES` names it, below the
ledger's rows. An unknown instance type is an error, never a zero price.

A row may carry no price (`usd_per_hour` empty) where no public figure is recorded: its `source`
says why and how to get one. Such a row gives the machine's shape (to `prices refresh` and to
listings) but is refused when a job is quoted, and it never hides a priced row of another file;
a refreshed or user-set price replaces it. One exception: a flex-start row with no figure is
quoted at its machine's on-demand price, where that has one, as an upper bound (DWS flex-start
is billed at its own, discounted rate), marked as such (`Quote.bound`, a warning); never at a
figure of our own.

`Catalog.price` is the one way a job is priced: the gate, `quote`, `forecast` (and so the
simulator) all call it (through `admission.prices.price_job`), so a part of a machine costs the
same everywhere.
"""

from __future__ import annotations

import contextlib
import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import date
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Protocol, TypeVar

from prefect_gpu_budget.units import (
    MICRO_PER_USD,
    SEGMENT_RE,
    BudgetInputError,
    near,
    shown,
    to_decimal_usd,
    usd_to_micro,
)

SHIPPED = Path(__file__).with_name("catalog.csv")
STALE_AFTER_DAYS = 90
PROVISIONINGS = ("on-demand", "spot", "flex-start")
COLUMNS = [
    "cloud",
    "instance_type",
    "provisioning",
    "gpu_model",
    "gpus",
    "vcpu",
    "memory_gib",
    "usd_per_hour",
    "source",
    "as_of",
    "verified",
]


@dataclass(frozen=True)
class PriceRow:
    cloud: str
    instance_type: str
    provisioning: str
    gpu_model: str
    gpus: int
    vcpu: int
    memory_gib: int
    usd_per_hour: Decimal | None
    """None: no public figure recorded; `source` says why."""
    source: str
    as_of: date
    verified: bool

    @property
    def key(self) -> str:
        return f"{self.cloud}:{self.instance_type}"

    @property
    def priced(self) -> bool:
        return self.usd_per_hour is not None


@dataclass(frozen=True)
class Quote:
    """The price of one job shape: what the gate reserves against, with honest warnings."""

    row: PriceRow
    nodes: int
    rate_micro_per_hour: int
    warnings: tuple[str, ...]
    bound: bool = False
    """True: no figure is recorded for this provisioning (flex-start), and the rate is the
    machine's on-demand price, an upper bound of what it is billed (`BOUND_NOTE`)."""

    def describe(self) -> str:
        """`aws:p4d.24xlarge (on-demand) x1: $2.74475/h`: the rate to the micro-dollar the
        gate charges (a part of a machine rarely comes to whole cents)."""
        usd = Decimal(self.rate_micro_per_hour) / MICRO_PER_USD
        rate = f"{usd:,.2f}" if usd == round(usd, 2) else f"{usd.normalize():,f}"
        return (
            f"{self.row.key} ({self.row.provisioning}) x{self.nodes}: "
            f"${rate}/h{' (upper bound)' if self.bound else ''}"
        )


BOUND_NOTE = "upper bound: on-demand price; flex-start is billed at its own discounted rate"
"""What a quote at the on-demand price for want of a flex-start figure says of itself."""


def refreshed_dir() -> Path:
    """Where `prices refresh` writes dated catalogs (`catalog-YYYY-MM-DD.csv`)."""
    from prefect_gpu_budget import settings

    return settings.catalog_dir()


def latest_refresh() -> Path | None:
    """The newest dated catalog written by `prices refresh`, if any."""
    folder = refreshed_dir()
    found = sorted(folder.glob("catalog-????-??-??.csv")) if folder.is_dir() else []
    return found[-1] if found else None


def _unpriced_local_hint(instance_type: str) -> str:
    """How to price a `local:` machine: `set-local`, or import the old file that prices it."""
    from prefect_gpu_budget import settings

    old = settings.prefect_home() / "gpu-budget" / "prices.csv"  # set-local's, before
    with contextlib.suppress(OSError, BudgetInputError):
        if old.is_file() and any(r.key == instance_type for r in read_price_file(old)):
            return (
                f" (this host's old price file {old} prices it; local prices are kept in the "
                f"ledger now: `prefect-gpu-budget prices import-local {old}`)"
            )
    return " (price it with `prefect-gpu-budget prices set-local`)"


MAX_GPUS = 64
"""Most accelerators one machine (one node of a job) has."""
MAX_VCPU = 4096
MAX_MEMORY_GIB = 65536
_INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,119}")


def _count(raw: dict[str, str], field: str, most: int) -> int:
    text = (raw.get(field) or "0").strip()
    if not text.isdigit() or int(text) > most:
        raise ValueError(f"{field} must be a whole number from 0 to {most}, got {shown(text)}")
    return int(text)


def parse_row(raw: dict[str, str], where: str) -> PriceRow:
    try:
        cloud, instance_type = raw["cloud"], raw["instance_type"]
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,31}", cloud or ""):
            raise ValueError(f"cloud must be a lower-case name, got {shown(cloud)}")
        name_ok = (
            SEGMENT_RE.fullmatch(instance_type or "")
            if cloud == "local"
            else _INSTANCE_RE.fullmatch(instance_type or "")
        )
        if not name_ok:  # no spaces, control characters or a final newline: one name, one row
            raise ValueError(f"instance_type is not a valid name, got {shown(instance_type)}")
        source = (raw.get("source") or "").strip()
        text = (raw["usd_per_hour"] or "").strip()
        price: Decimal | None = None
        if text:
            price = to_decimal_usd(text, "usd_per_hour")
            if price <= 0:
                raise ValueError("usd_per_hour must be above $0 (a price is never zero)")
        elif not source:
            raise ValueError("usd_per_hour is empty: a row without a price says why in source")
        return PriceRow(
            cloud=cloud,
            instance_type=instance_type,
            provisioning=raw["provisioning"].strip(),
            gpu_model=raw.get("gpu_model", "").strip(),
            gpus=_count(raw, "gpus", MAX_GPUS),
            vcpu=_count(raw, "vcpu", MAX_VCPU),
            memory_gib=_count(raw, "memory_gib", MAX_MEMORY_GIB),
            usd_per_hour=price,
            source=source,
            as_of=date.fromisoformat(raw["as_of"].strip()),
            verified=raw.get("verified", "no").strip().lower() in ("yes", "true", "1"),
        )
    except (KeyError, ValueError, AttributeError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BudgetInputError(
            "prices",
            f"bad row {raw.get('cloud')}:{shown(raw.get('instance_type'))} in {where}: {first}",
        ) from None


def read_price_file(path: Path) -> list[PriceRow]:
    """The rows of a prices CSV, each checked (one line naming the file and row)."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            return [parse_row(raw, str(path)) for raw in csv.DictReader(handle)]
    except UnicodeDecodeError as exc:
        raise BudgetInputError(
            "prices", f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from None
    except csv.Error as exc:
        raise BudgetInputError("prices", f"{path} is not a prices CSV ({exc})") from None


class Catalog:
    """Price rows by (`cloud:instance_type`, provisioning); later files override earlier ones:
    the shipped catalog, then the newest refreshed one, then the user's own prices. A row
    without a price never replaces one with a price."""

    def __init__(self, rows: list[PriceRow]) -> None:
        self._rows: dict[tuple[str, str], PriceRow] = {}
        for row in rows:
            earlier = self._rows.get((row.key, row.provisioning))
            if row.priced or earlier is None or not earlier.priced:
                self._rows[row.key, row.provisioning] = row

    @classmethod
    def load(cls, *extra: Path, local: Iterable[PriceRow] = ()) -> Catalog:
        """The shipped catalog, the newest refreshed one, `extra` files, the price file
        `PREFECT_GPU_BUDGET_PRICES` names, then `local` rows: a ledger's local prices, which
        the caller that has the ledger reads (`admission.prices.ledger_prices`)."""
        return cls([*file_rows(*extra), *local])

    def rows(self) -> list[PriceRow]:
        return list(self._rows.values())

    def row(self, instance_type: str, provisioning: str = "on-demand") -> PriceRow:
        if ":" not in instance_type:
            raise BudgetInputError(
                "instance_type",
                f"must be 'cloud:type' like 'aws:g5.xlarge', got {shown(instance_type)}",
            )
        if provisioning not in PROVISIONINGS:
            raise BudgetInputError(
                "provisioning",
                f"must be one of {', '.join(PROVISIONINGS)}, got {shown(provisioning)}",
            )
        found = self._rows.get((instance_type, provisioning))
        if found is None:
            known = sorted({key for key, prov in self._rows if prov == provisioning})
            hint = _unpriced_local_hint(instance_type) if instance_type.startswith("local:") else ""
            close = near(instance_type, known, most=3)
            listed = (
                f"did you mean {close[0]}?"
                if close
                else f"known: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}"
            )
            raise BudgetInputError(
                "instance_type",
                f"no {provisioning} price for {shown(instance_type)}{hint}; {listed}",
            )
        return found

    def quote(
        self,
        instance_type: str,
        nodes: int = 1,
        provisioning: str = "on-demand",
        today: date | None = None,
    ) -> Quote:
        row = self.row(instance_type, provisioning)
        bound = False
        if row.usd_per_hour is None:
            on_demand = self._bound_of(row)
            if on_demand is None:
                raise BudgetInputError(
                    "instance_type",
                    f"no {provisioning} price for {row.key}: {' '.join(row.source.split())}",
                )
            row, bound = on_demand, True
        warnings = []
        priced_as = "on-demand" if bound else provisioning
        age = ((today or date.today()) - row.as_of).days
        if bound:
            warnings.append(f"price of {row.key} ({provisioning}) is an {BOUND_NOTE}")
        if age > STALE_AFTER_DAYS:
            warnings.append(
                f"price of {row.key} ({priced_as}) is stale: from {row.as_of}, {age} days old"
            )
        if not row.verified:
            warnings.append(f"price of {row.key} ({priced_as}) is unverified: {row.source}")
        if bound:  # the job's own provisioning, on the on-demand figure and its source
            row = replace(
                row,
                provisioning=provisioning,
                source=f"{row.source} (the on-demand price: an upper bound for {provisioning})",
                verified=False,
            )
        rate = usd_to_micro(row.usd_per_hour) * nodes
        return Quote(
            row=row, nodes=nodes, rate_micro_per_hour=rate, warnings=tuple(warnings), bound=bound
        )

    def _bound_of(self, row: PriceRow) -> PriceRow | None:
        """The priced on-demand row of a flex-start row with no figure: its upper bound."""
        if row.provisioning != "flex-start":
            return None
        on_demand = self._rows.get((row.key, "on-demand"))
        return on_demand if on_demand is not None and on_demand.priced else None

    def bound_of(self, instance_type: str, provisioning: str) -> Decimal | None:
        """The on-demand price a quote of this row with no figure is charged, if any."""
        found = self._rows.get((instance_type, provisioning))
        bound = None if found is None or found.priced else self._bound_of(found)
        return None if bound is None else bound.usd_per_hour

    def price(self, job: Priceable[Share], today: date | None = None) -> tuple[Quote, Share]:
        """The one way a job is priced (the gate, `quote`, `forecast` and so the simulator, all
        through `admission.prices.price_job`): its machines' quote, then its part of them
        (`GpuJob.priced`: a 1-GPU share of an 8-GPU machine pays 1/8 of its price); with what
        each node takes of a machine (a `NodeShare` for a `GpuJob`, None for `Machines`)."""
        machines = self.quote(job.instance_type, job.nodes, job.provisioning, today=today)
        return job.priced(machines)


@dataclass(frozen=True)
class Machines:
    """Whole machines of one type, asking no part of them: what `quote` prices without
    loading the job model (`GpuJob` prices the same shape the same way)."""

    instance_type: str
    nodes: int = 1
    provisioning: str = "on-demand"

    def priced(self, quote: Quote) -> tuple[Quote, None]:
        return quote, None


Share = TypeVar("Share", covariant=True)


class Priceable(Protocol[Share]):
    """What `Catalog.price` prices: a shape of machines that says its part of them (`GpuJob`,
    `Machines`)."""

    @property
    def instance_type(self) -> str: ...
    @property
    def nodes(self) -> int: ...
    @property
    def provisioning(self) -> str: ...
    def priced(self, quote: Quote) -> tuple[Quote, Share]: ...


def set_local_price(
    name: str,
    usd_per_hour: object,
    gpus: int = 1,
    *,
    path: Path,
    vcpu: int = 0,
    memory_gib: int = 0,
) -> Path:
    """Price a `local:<name>` machine in the CSV `path` (replacing an older row), to import or
    name in `PREFECT_GPU_BUDGET_PRICES` (every host: `set_ledger_price`). Its vCPU and memory
    (0: unknown) are what one job on it takes of a capacity pool's machine."""
    row = local_row(name, usd_per_hour, gpus, vcpu, memory_gib)
    rows = read_price_file(path) if path.exists() else []
    rows = [r for r in rows if not (r.cloud == "local" and r.instance_type == name)]
    write_rows(path, [*rows, row])
    return path


def write_rows(path: Path, rows: list[PriceRow]) -> None:
    """Write price rows as a catalog CSV (the shipped file's columns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(row_cells(r) for r in rows)
    cached_file_rows.cache_clear()  # the process's catalog is built again over the new rows


def row_cells(r: PriceRow) -> list[object]:
    """A row's cells in the catalog CSV's columns (`COLUMNS`)."""
    return [
        r.cloud,
        r.instance_type,
        r.provisioning,
        r.gpu_model,
        r.gpus,
        r.vcpu,
        r.memory_gib,
        "" if r.usd_per_hour is None else r.usd_per_hour,
        r.source,
        r.as_of.isoformat(),
        "yes" if r.verified else "no",
    ]


LOCAL_GPU, LOCAL_CPU = "local GPU", "local CPU"
"""The model of a `local:` row priced without one: it names no accelerator model."""


def local_row(name: str, usd_per_hour: object, gpus: int, vcpu: int, memory_gib: int) -> PriceRow:
    """A `local:<name>` row priced by the admin, checked (one line naming the field)."""
    if not isinstance(name, str) or not SEGMENT_RE.fullmatch(name):
        raise BudgetInputError("name", f"must be 1-48 of a-z 0-9 - _, got {shown(name)}")
    price = to_decimal_usd(usd_per_hour, "usd_per_hour")
    if price <= 0:
        raise BudgetInputError("usd_per_hour", "must be above $0 (a price is never zero)")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise BudgetInputError("gpus", f"must be between 0 and {MAX_GPUS}, got {shown(gpus)}")
    for field, value, most in (
        ("vcpu", vcpu, MAX_VCPU),
        ("memory_gib", memory_gib, MAX_MEMORY_GIB),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
            raise BudgetInputError(field, f"must be between 0 and {most}, got {shown(value)}")
    return PriceRow(
        "local",
        name,
        "on-demand",
        LOCAL_GPU if gpus else LOCAL_CPU,
        gpus,
        vcpu,
        memory_gib,
        price,
        "priced by user",
        date.today(),
        True,
    )


@lru_cache(maxsize=1)
def cached_file_rows() -> tuple[PriceRow, ...]:
    """`file_rows()`, read once per process (again after `write_rows`, or once cleared: the
    same tuple until then, so a catalog built over it can tell it is current)."""
    return tuple(file_rows())


def file_rows(*extra: Path) -> list[PriceRow]:
    """The rows of the files: shipped, newest refreshed, `extra`, the price file this host's
    `PREFECT_GPU_BUDGET_PRICES` names (`settings.prices_path`)."""
    from prefect_gpu_budget import settings

    refreshed = latest_refresh()
    paths = [SHIPPED, *([refreshed] if refreshed else []), *extra]
    user = settings.prices_path()
    if user is not None and user.exists():
        paths.append(user)
    return [row for path in paths for row in read_price_file(path)]
