"""`SpendLedger`: where the durable ledger lives (SQLite file by default, PostgreSQL shared)."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from prefect_gpu_budget import settings
from prefect_gpu_budget.admission.ledger import Ledger, open_ledger


class SpendLedger(Block):
    """The database that records every admission from request to settlement.

    Leave `database_url` empty for a SQLite file under PREFECT_HOME (one machine); give a
    PostgreSQL URL (`postgresql://user@host/db`) to share budgets between machines.
    """

    _block_type_name = "GPU Spend Ledger"
    _block_type_slug = "gpu-spend-ledger"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "Database URL of the GPU spend ledger (SQLite by default, PostgreSQL shared)."

    database_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL of the ledger; empty means a SQLite file under PREFECT_HOME.",
    )

    def url(self) -> str:
        explicit = None if self.database_url is None else self.database_url.get_secret_value()
        return settings.ledger_url(explicit)

    def ledger(self) -> Ledger:
        """One open ledger per URL and process (engines pool their connections)."""
        return open_ledger(self.url())
