"""Setting a scope's budget: the one act behind `budget set` and `GpuBudget.apply()`.

1. Refuse a scope whose org or team has no budget yet and whose name is close to a known one
   (a typo makes a new org or team); `new` creates it all the same.
2. Merge the fields given into the scope's budget as it stands, inside the transaction that
   holds the org's lock: concurrent changes to different fields both survive, a bad value
   writes nothing.
3. Say when the cap given was not whole cents, and when a parent's budget binds first.
4. Resize the scope's Prefect limit now (not at its next admission), when a Prefect API is
   configured.

It imports neither Prefect nor pandas: `budget set` stays a light command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.units import BudgetInputError, fmt_usd


@dataclass
class BudgetChange:
    """What setting a budget did: the rule written, and what its setter should be told."""

    rule: BudgetRule
    warnings: list[str] = field(default_factory=list)


def set_budget(
    ledger: Any,
    scope: str,
    changes: Mapping[str, Any],
    *,
    template: bool = False,
    new: bool = False,
    need_a_bound: bool = True,
) -> BudgetChange:
    """Create or change `scope`'s budget (or, with `template`, a team's session template):
    the fields in `changes` change, the others keep their current values.

    `need_a_bound` refuses a budget with neither a cap nor a period budget (`budget set`
    does; a `GpuBudget` block may register a scope without either). Warnings are returned,
    one line each, for the caller to print or log."""
    from prefect_gpu_budget.admission.admin_settings import BudgetSettings
    from prefect_gpu_budget.units import validate_scope

    validate_scope(scope)
    if not new:
        refuse_near_miss(scope, {r.scope for r in ledger.config.budgets()})
    if changes.get("hourly_cap_usd") is not None:  # one line before opening the ledger
        BudgetSettings(scope=scope, hourly_cap_usd=changes["hourly_cap_usd"])

    def merge(current: BudgetRule | None) -> BudgetRule:
        fields: dict[str, Any] = {"scope": scope}
        if current is not None:
            fields.update(BudgetSettings.fields_of(current))
        fields.update(changes)
        none = fields.get("hourly_cap_usd") is None and fields.get("period_budget_usd") is None
        if need_a_bound and none:
            raise BudgetInputError("budget", "give --hourly-cap, --period-budget or both")
        return BudgetSettings(**fields).rule()

    rule = ledger.config.update_budget(scope, merge, template=template)
    done = BudgetChange(rule, cap_rounded(changes.get("hourly_cap_usd"), rule))
    done.warnings += parents_binding(ledger, rule)
    if not template:
        done.warnings += resize_prefect_limit(rule)
    return done


def refuse_near_miss(scope: str, known: set[str]) -> None:
    """A typo makes a new org or team: `acme/visoin/agent-7` beside `acme/vision`. A scope
    whose org or team has no budget yet, and whose name is close to a known one, is refused
    with what it may have meant."""
    from prefect_gpu_budget.units import near, scope_path

    if scope in known:
        return
    for path in scope_path(scope)[:2]:  # the org, then the team
        if path in known:
            continue
        peers = {k for k in known if k.count("/") == path.count("/")}
        close = near(path, peers)
        if close:
            raise BudgetInputError(
                "scope", f"{path} has no budget; did you mean {close[0]}? (--new creates it)"
            )


def cap_rounded(given: Any, rule: BudgetRule) -> list[str]:
    """A cap is kept in whole cents per hour, rounded down (Prefect's limit counts cents): say
    so when the cap given was not, above all when it rounds to nothing and admits no job."""
    from prefect_gpu_budget.units import usd_to_micro

    if given is None or rule.hourly_cap_cents is None:
        return []
    if usd_to_micro(given) == rule.hourly_cap_cents * 10_000:
        return []
    kept = fmt_usd(rule.hourly_cap_cents * 10_000)
    tail = ": no job will be admitted in it" if rule.hourly_cap_cents == 0 else ""
    return [
        f"the cap ${given}/h of {rule.scope} is kept as {kept}/h (caps are "
        f"whole cents per hour, rounded down){tail}"
    ]


def parents_binding(ledger: Any, rule: BudgetRule) -> list[str]:
    """A cap or budget above its parent's is allowed, but the parent binds: say so."""
    from prefect_gpu_budget.units import scope_path

    said = []
    for parent in reversed(ledger.config.path_budgets(rule.scope)):
        if parent.scope == rule.scope or parent.scope not in scope_path(rule.scope):
            continue
        mine, theirs = rule.hourly_cap_cents, parent.hourly_cap_cents
        if mine is not None and theirs is not None and mine > theirs:
            said.append(
                f"the cap {fmt_usd(mine * 10_000)}/h of {rule.scope} is above the "
                f"{fmt_usd(theirs * 10_000)}/h of {parent.scope}, which binds"
            )
        mine, theirs = rule.period_budget_micro, parent.period_budget_micro
        if (
            mine is not None
            and theirs is not None
            and mine > theirs
            and rule.period == parent.period
        ):
            said.append(
                f"the {rule.period} budget {fmt_usd(mine)} of {rule.scope} is above "
                f"the {fmt_usd(theirs)} of {parent.scope}, which binds"
            )
    return said


def resize_prefect_limit(rule: BudgetRule) -> list[str]:
    """Show a new cap in the Prefect UI now, not at the scope's next admission."""
    from prefect_gpu_budget.settings import prefect_api_auth, prefect_api_url

    api = prefect_api_url()
    if rule.hourly_cap_cents is None or not api:
        return []
    from prefect_gpu_budget.admission.limits import limit_name, resize_over_http

    why = resize_over_http(rule.scope, rule.hourly_cap_cents, api, prefect_api_auth())
    if not why:
        return []
    return [
        f"Prefect's limit {limit_name(rule.scope)} keeps its old cap until the "
        f"next admission in {rule.scope}: {why}"
    ]
