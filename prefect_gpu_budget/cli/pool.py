"""`pool set` and `pool quota`: capacity pools and the teams' quotas in them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from prefect_gpu_budget.cli.common import console, current_ledger
from prefect_gpu_budget.cli.tables import resources
from prefect_gpu_budget.units import org_of

pool_app = typer.Typer(name="pool", help="Capacity pools and team quotas.", no_args_is_help=True)


@pool_app.command("set")
def pool_set(
    org: str = typer.Argument(...),
    name: str = typer.Argument(...),
    nodes: int = typer.Option(..., help="Machines (or quota units) in the pool."),
    gpus_per_node: int = typer.Option(...),
    vcpu_per_node: int = typer.Option(0),
    memory_gib_per_node: int = typer.Option(0),
    gpu_model: str = typer.Option(""),
    instance_type: list[str] = typer.Option([], help="Jobs on this type run here (repeat)."),
    kind: str = typer.Option("inventory", help="inventory or quota."),
    backfill: bool = typer.Option(False, help="Let small jobs pass a blocked big one."),
) -> None:
    """Create or replace a capacity pool; its team quotas stay as they are."""
    from prefect_gpu_budget.admission.admin_settings import PoolSettings

    block = PoolSettings(
        org=org,
        name=name,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        vcpu_per_node=vcpu_per_node,
        memory_gib_per_node=memory_gib_per_node,
        gpu_model=gpu_model,
        instance_types=instance_type,
        kind=kind,
        backfill=backfill,
    )
    _refuse_unpriced(instance_type)
    current_ledger().config.set_pool(
        block.pool()
    )  # its quotas stay: a concurrent `pool quota` survives
    console.print(f"pool {org}/{name}: {nodes} x {gpus_per_node} {gpu_model}".rstrip())


@pool_app.command("quota")
def pool_quota(
    team: str = typer.Argument(..., help="org/team"),
    pool: str = typer.Option(..., help="The pool's name."),
    gpus: int = typer.Option(
        None, help="Accelerators guaranteed to the team (nominal quota); needed for a new team."
    ),
    vcpu: int = typer.Option(None, help="Default: in proportion to --gpus."),
    memory_gib: int = typer.Option(None, help="Default: in proportion to --gpus."),
    borrow_pct: int = typer.Option(
        None, help="May borrow this % of its quota more (50, as HyperPod's BorrowLimit)."
    ),
    lend_pct: int = typer.Option(None, help="% of its idle quota others may borrow (100)."),
    weight: int = typer.Option(None, help="Fair share of idle capacity, 0-100 (50)."),
    reclaim: str = typer.Option(
        None,
        help="Take back lent capacity from any borrower, lower_priority ones only, or never "
        "(any; Kueue's reclaimWithinCohort).",
    ),
    within_team: str = typer.Option(
        None,
        help="Preempt the team's own lower-priority work: lower_priority or never "
        "(lower_priority; HyperPod's PreemptTeamTasks).",
    ),
    queueing: str = typer.Option(
        None,
        help="best_effort_fifo: a job that cannot start lets the team's next ones try; "
        "strict_fifo: they wait behind it (best_effort_fifo).",
    ),
) -> None:
    """Set one team's quota in a pool (HyperPod-style: vCPU and memory follow the GPUs), its
    lending, borrowing and fair share, and its preemption and queueing settings. What is left
    out keeps the team's current value (or the default, for a new team)."""
    from prefect_gpu_budget.units import validate_scope

    org = org_of(validate_scope(team, "team"))
    change = QuotaChange.of(team, pool, gpus, vcpu, memory_gib, borrow_pct, lend_pct, weight)
    change.given.update(_policies(reclaim=reclaim, within_team=within_team, queueing=queueing))
    # read, change and write in one locked transaction: a concurrent change to another team's
    # quota, or to the pool, survives
    target, new = current_ledger().config.set_team_quota(org, pool, change.make, team=team)
    console.print(
        f"{team} in {org}/{pool}: {resources(new.quota, target.gpu_model)}, borrow "
        f"{new.borrow_pct}%, lend {new.lend_pct}%, weight {new.weight}; reclaim {new.reclaim}, "
        f"within team {new.within_team}, {new.queueing}"
    )


def _refuse_unpriced(instance_types: list[str]) -> None:
    """A job of an unpriced type could never be quoted: refuse a pool that names one."""
    from prefect_gpu_budget.admission.prices import default_catalog

    catalog = default_catalog()
    for instance in instance_types:
        rows = [row for row in catalog.rows() if row.key == instance]
        if not any(row.priced for row in rows):  # a price for any provisioning will do
            # says why: the nearest known type, or the reason the catalog has no figure
            catalog.quote(instance, provisioning=rows[0].provisioning if rows else "on-demand")


def _policies(**given: str | None) -> dict[str, str]:
    """The preemption and queueing settings given, each checked (a one-line error before
    anything is written)."""
    from prefect_gpu_budget.admission.rules.quota import team_setting

    return {name: team_setting(name, value) for name, value in given.items() if value is not None}


@dataclass
class QuotaChange:
    """One `pool quota`: the team's new quota and settings, made from what it has now."""

    team: str
    pool: str
    gpus: int | None
    vcpu: int | None
    memory_gib: int | None
    share: Any
    given: dict[str, Any]

    @classmethod
    def of(cls, team, pool, gpus, vcpu, memory_gib, borrow_pct, lend_pct, weight) -> QuotaChange:
        """Checks the figures given (the team's share) before anything is read."""
        from prefect_gpu_budget.admission.admin_settings import TeamShare

        shares = {"borrow_pct": borrow_pct, "lend_pct": lend_pct, "weight": weight}
        share = TeamShare(
            team=team,
            gpus=gpus or 0,
            vcpu=vcpu,
            memory_gib=memory_gib,
            **{k: v for k, v in shares.items() if v is not None},
        )
        return cls(team, pool, gpus, vcpu, memory_gib, share, dict(shares))

    def make(self, target: Any, current: Any) -> Any:
        """The team's quota in `target`, from `current` (None for a new team): what is left
        out keeps the team's current value, or the default."""
        from prefect_gpu_budget.admission.rules.quota import TeamQuota

        base = current or TeamQuota(self.pool, self.team, (0, 0, 0))
        kept = {
            name: getattr(base, name) if self.given.get(name) is None else self.given[name]
            for name in ("borrow_pct", "lend_pct", "weight", "reclaim", "within_team", "queueing")
        }
        return TeamQuota(self.pool, self.team, self._quota(target, current), **kept)

    def _quota(self, target: Any, current: Any) -> tuple[int, int, int]:
        from prefect_gpu_budget.admission.rules.quota import proportional
        from prefect_gpu_budget.units import BudgetInputError

        if self.gpus is not None:
            return proportional(target, self.gpus, self.share.vcpu, self.share.memory_gib)
        if current is None:
            org = org_of(self.team)
            raise BudgetInputError(
                "gpus", f"{self.team} has no quota in {org}/{self.pool} yet: give --gpus"
            )
        g, v, m = current.quota  # only the options given change
        return (
            g,
            v if self.vcpu is None else self.vcpu,
            m if self.memory_gib is None else self.memory_gib,
        )
