"""The cloud's own bill, from its export to what an import did.

- `lines`: one line of a bill (`BillLine`), the error a bad export gets (`BillError`);
- the readers: `aws_cur2` (CUR 2.0), `gcp_billing` (GCP's export), `files` (local files in
  either schema), over one row opener (`reading`);
- `sources`: one source type per kind of export behind `BillSource`, the registry
  `SOURCE_TYPES` (the `BillingExport` block's kinds);
- `imports`: the one door, `import_export` (read a source, import each period whole into a
  `BillStore`, which the ledger's `Ledger.bills` is);
- `results`: what an import did (`BillImport`, `HeldBill`, `OverByBill`), and how it reads;
- `trueup`: the pure rules that true the ledger up from the bill (whose a line is, when a
  figure is final, which periods a daily import reads).

The names below load on first use (PEP 562): `lines` and `trueup` are pure rules
(`tests/test_layers.py`), and importing them runs this package first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_gpu_budget._lazy import lazy_exports

_PUBLIC = {
    "SOURCES": "prefect_gpu_budget.billing.lines",
    "BillError": "prefect_gpu_budget.billing.lines",
    "BillLine": "prefect_gpu_budget.billing.lines",
    "read_bill_files": "prefect_gpu_budget.billing.files",
    "SOURCE_TYPES": "prefect_gpu_budget.billing.sources",
    "BillSource": "prefect_gpu_budget.billing.sources",
    "BillStore": "prefect_gpu_budget.billing.imports",
    "import_export": "prefect_gpu_budget.billing.imports",
    "import_lines": "prefect_gpu_budget.billing.imports",
    "BillImport": "prefect_gpu_budget.billing.results",
    "HeldBill": "prefect_gpu_budget.billing.results",
    "OverByBill": "prefect_gpu_budget.billing.results",
    "summary": "prefect_gpu_budget.billing.results",
    "periods_to_read": "prefect_gpu_budget.billing.trueup",
}

__all__ = [
    "SOURCES",
    "SOURCE_TYPES",
    "BillError",
    "BillImport",
    "BillLine",
    "BillSource",
    "BillStore",
    "HeldBill",
    "OverByBill",
    "import_export",
    "import_lines",
    "periods_to_read",
    "read_bill_files",
    "summary",
]

if TYPE_CHECKING:
    from prefect_gpu_budget.billing.files import read_bill_files
    from prefect_gpu_budget.billing.imports import BillStore, import_export, import_lines
    from prefect_gpu_budget.billing.lines import SOURCES, BillError, BillLine
    from prefect_gpu_budget.billing.results import BillImport, HeldBill, OverByBill, summary
    from prefect_gpu_budget.billing.sources import SOURCE_TYPES, BillSource
    from prefect_gpu_budget.billing.trueup import periods_to_read

__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
