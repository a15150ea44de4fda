"""The catalog's rate for each matching machine, the way the gate prices a job (`Catalog.quote`:
a flex-start row with no figure at its on-demand bound). A machine the catalog cannot price is
not offered; `unpriced` says why, for `quote` to show."""

from __future__ import annotations

from collections.abc import Iterable

from prefect_gpu_budget.placement.accelerators import Shape
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import BudgetInputError

Rates = dict[tuple[str, str], int]


def catalog_rates(catalog: Catalog, shapes: Iterable[Shape]) -> tuple[Rates, dict[str, str]]:
    """Micro-dollars an hour per node by `(cloud:instance_type, provisioning)`, and the reason
    each machine left out has no price."""
    rates: Rates = {}
    unpriced: dict[str, str] = {}
    for shape in shapes:
        key = f"{shape.cloud}:{shape.instance_type}"
        try:
            quote = catalog.quote(key, 1, shape.provisioning)
        except BudgetInputError as exc:
            unpriced[f"{key} {shape.provisioning}"] = exc.rule
            continue
        rates[key, shape.provisioning] = quote.rate_micro_per_hour
    return rates, unpriced
