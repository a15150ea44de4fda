"""Admin configuration (admission/ledger/config.py): what cannot be a budget is refused and not
written."""

from __future__ import annotations

import pytest

from prefect_gpu_budget.admission.rules.policy import BudgetRule


def test_a_cap_beyond_what_a_prefect_limit_holds_is_refused_and_not_written(ledger):

    from prefect_gpu_budget.units import BudgetInputError

    for write in (ledger.config.set_budget, ledger.config.set_session_template):
        with pytest.raises(BudgetInputError, match="^hourly_cap: must be at most"):
            write(BudgetRule("big/team", hourly_cap_cents=2**31))
    assert ledger.config.budgets() == [] and ledger.config.session_templates() == []
    ledger.config.set_budget(BudgetRule("big", hourly_cap_cents=2**31 - 1))
    assert [r.hourly_cap_cents for r in ledger.config.budgets()] == [2**31 - 1]
