"""`prices refresh`: fetch current prices from the clouds, write a dated catalog, say what changed.

The fetchers (`pricing.aws`, `pricing.gcp`) return rows for the instance types we know; this
module merges them over the current catalog, writes `catalog-YYYY-MM-DD.csv` into the refreshed
catalogs folder (the newest is loaded over the shipped one) and lists the differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from pathlib import Path

from prefect_gpu_budget.pricing.catalog import Catalog, PriceRow, refreshed_dir, write_rows


@dataclass(frozen=True)
class Change:
    key: str
    provisioning: str
    old_usd: Decimal | None
    new_usd: Decimal

    def describe(self) -> str:
        if self.old_usd is None:
            return f"{self.key} ({self.provisioning}): new, ${self.new_usd}/h"
        pct = (self.new_usd - self.old_usd) / self.old_usd * 100 if self.old_usd else Decimal(0)
        return (
            f"{self.key} ({self.provisioning}): ${self.old_usd}/h -> ${self.new_usd}/h "
            f"({pct:+.1f}%)"
        )


def changes(old: Catalog, fetched: list[PriceRow]) -> list[Change]:
    """Rows whose price is new or differs from the catalog in use."""
    before = {(r.key, r.provisioning): r.usd_per_hour for r in old.rows()}
    out = []
    for row in fetched:
        was = before.get((row.key, row.provisioning))
        if was != row.usd_per_hour:
            out.append(Change(row.key, row.provisioning, was, row.usd_per_hour))
    return sorted(out, key=lambda c: (c.key, c.provisioning))


def write_refresh(
    old: Catalog, fetched: list[PriceRow], folder: Path | None = None, today: date | None = None
) -> Path:
    """The current rows with the fetched ones laid over them, as today's dated catalog."""
    merged = {(r.key, r.provisioning): r for r in old.rows() if r.cloud != "local"}
    merged.update({(r.key, r.provisioning): r for r in fetched})
    path = (folder or refreshed_dir()) / f"catalog-{(today or date.today()).isoformat()}.csv"
    write_rows(
        path, sorted(merged.values(), key=lambda r: (r.cloud, r.instance_type, r.provisioning))
    )
    return path
