"""The catalog this process prices with: the catalog's files (`pricing.catalog`) and the local
machines' prices of its ledger, which this side reads and hands to the catalog (pricing reads
no ledger); `price_job`, the one way a job is priced; and a local machine priced in the ledger.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import date
from typing import Any

from prefect_gpu_budget import settings
from prefect_gpu_budget.admission.ledger.local_prices import LocalPrices, stored_rows
from prefect_gpu_budget.pricing.catalog import (
    Catalog,
    Priceable,
    PriceRow,
    Quote,
    Share,
    cached_file_rows,
    local_row,
    parse_row,
)
from prefect_gpu_budget.units import BudgetInputError

LEDGER_PRICES_TTL_S = 2.0
"""How long a process prices with the ledger's local prices as it last read them: a price set
on another host is used everywhere within this (and at once by the process that set it)."""
LEDGER_SOURCE = "the ledger's local prices"


def ledger_price_rows(stored: Iterable[dict[str, str]]) -> list[PriceRow]:
    """The `local:` catalog rows of a ledger's local price list (`stored`: its rows, their
    fields as text), checked as a CSV's rows are."""
    return [
        parse_row(
            {
                **raw,
                "cloud": "local",
                "instance_type": raw["name"],
                "provisioning": "on-demand",
                "verified": "yes",
            },
            LEDGER_SOURCE,
        )
        for raw in stored
    ]


def ledger_prices(url: str | None = None) -> list[PriceRow]:
    """The `local:` rows of the ledger at `url` (else this process's ledger), checked as a
    CSV's rows are; none from a ledger not made yet."""
    return ledger_price_rows(stored_rows(settings.ledger_url(url)))


_default: dict[str, Any] = {}
_default_lock = threading.Lock()


def default_catalog() -> Catalog:
    """The catalog of this process: the files (read once, again after `write_rows`) and its
    ledger's local prices (read again once they are `LEDGER_PRICES_TTL_S` old)."""
    url = settings.ledger_url()
    with _default_lock:
        now, files = time.monotonic(), cached_file_rows()
        fresh = (
            _default.get("url") == url
            and _default.get("files") is files
            and now - _default["at"] < LEDGER_PRICES_TTL_S
        )
        if not fresh:
            local = ledger_prices(url)
            same = _default.get("url") == url and _default.get("files") is files
            if not same or _default.get("local") != local:
                _default["catalog"] = Catalog([*files, *local])
                _default["local"] = local
            _default.update(url=url, files=files, at=now)
        return _default["catalog"]  # type: ignore[no-any-return]


def _clear_default() -> None:
    """Read the files and the ledger again on next use."""
    with _default_lock:
        _default.clear()
    cached_file_rows.cache_clear()


default_catalog.cache_clear = _clear_default  # type: ignore[attr-defined]


def price_job(
    job: Priceable[Share], catalog: Catalog | None = None, today: date | None = None
) -> tuple[Quote, Share]:
    """The one way a job is priced (the gate, `quote`, `forecast` and so the simulator):
    `Catalog.price` of `catalog`, else of this process's catalog (`default_catalog`)."""
    return (catalog or default_catalog()).price(job, today)


def store_local_price(row: PriceRow, ledger: Any) -> None:
    """Write a `local:` row into `ledger` (a `Ledger`), replacing its older price; this
    process prices with it at once."""
    if row.cloud != "local" or row.provisioning != "on-demand" or row.usd_per_hour is None:
        raise BudgetInputError(
            "prices",
            f"only priced on-demand local: rows go in the ledger, got {row.key} "
            f"({row.provisioning})",
        )
    LocalPrices(ledger.db).set(
        {
            "name": row.instance_type,
            "usd_per_hour": str(row.usd_per_hour),
            "gpu_model": row.gpu_model,
            "gpus": row.gpus,
            "vcpu": row.vcpu,
            "memory_gib": row.memory_gib,
            "source": row.source,
            "as_of": row.as_of.isoformat(),
        }
    )
    default_catalog.cache_clear()  # type: ignore[attr-defined]


def set_ledger_price(
    name: str,
    usd_per_hour: object,
    gpus: int = 1,
    *,
    ledger: Any,
    vcpu: int = 0,
    memory_gib: int = 0,
) -> PriceRow:
    """Price a `local:<name>` machine in the ledger, for every host and replica on it."""
    row = local_row(name, usd_per_hour, gpus, vcpu, memory_gib)
    store_local_price(row, ledger)
    return row
