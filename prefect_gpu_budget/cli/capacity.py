"""`capacity`, `pool set`, `pool quota` and `priority ...`: pools, team quotas, priority
classes."""

from __future__ import annotations

import json

import typer

from prefect_gpu_budget.cli.common import console, current_ledger, fail
from prefect_gpu_budget.cli.tables import Col, print_table
from prefect_gpu_budget.units import org_of


def _res(r: tuple[int, int, int], model: str = "") -> str:
    return f"{r[0]} {model} / {r[1]} vCPU / {r[2]} GiB".replace("  ", " ")


_POOL_COLUMNS = (
    Col("team"),
    Col("quota", "name"),
    Col("used", "name"),
    Col("borrowed", drop=1),
    Col("lent", drop=2),
    Col("borrow / lend / weight", "name", drop=3),
    Col("reclaim / within team / queue", "name", drop=4),
)


def print_pool(pool: dict) -> None:
    rows = [
        (
            t["team"],
            _res(t["quota"], pool["gpu_model"]),
            _res(t["used"]),
            str(t["borrowed"][0]),
            str(t["lent"][0]),
            f"{t['borrow_pct']}% / {t['lend_pct']}% / {t['weight']}",
            f"{t['reclaim']} / {t['within_team']} / {t['queueing']}",
        )
        for t in pool["teams"]
    ]
    console.print(
        f"pool {pool['org']}/{pool['pool']} ({pool['kind']}, {pool['nodes']} x "
        f"{_res(pool['node'], pool['gpu_model'])}): {pool['used'][0]} of {pool['total'][0]} "
        "accelerators in use"
    )
    if rows:
        print_table(_POOL_COLUMNS, rows)
    for q in pool["queue"]:
        console.print(f"[yellow]queued[/] {q['job_id'][:8]} {q['scope']}: {q['reason']}")


def capacity(
    org: str = typer.Argument(..., help="The org whose pools to show."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Per capacity pool: each team's quota, used, borrowed and lent, and the queue."""
    from prefect_gpu_budget.units import validate_scope

    ledger = current_ledger()
    pools = ledger.views.capacity_status(validate_scope(org, "org"))
    if as_json:
        typer.echo(json.dumps(pools, indent=2))
        return
    for pool in pools:
        print_pool(pool)
    if not pools:
        console.print(f"no capacity pools in {org}")
    classes = ledger.config.priority_classes(org)
    console.print("priority classes: " + ", ".join(f"{c['name']}={c['value']}" for c in classes))


def priority_set(
    org: str = typer.Argument(...),
    name: str = typer.Argument(..., help="The class's name, as jobs give it in `priority`."),
    value: int = typer.Option(..., help="-1000..1000: higher is admitted first."),
    description: str = typer.Option("", help="What the class is for."),
) -> None:
    """Define (or redefine) a priority class of an org; jobs recorded from now on that name it
    get its value."""
    current_ledger().config.set_priority_class(org, name, value, description)
    console.print(f"priority class {name} of {org}: {value}")


def priority_remove(org: str = typer.Argument(...), name: str = typer.Argument(...)) -> None:
    """Remove an org's own class (jobs already recorded keep their priority)."""
    if not current_ledger().config.remove_priority_class(org, name):
        fail(f"name: {org} has no priority class {name!r} of its own")
    console.print(f"priority class {name} of {org} removed")


def priority_list(
    org: str = typer.Argument(...), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Every class a job of the org may name, highest first, and who defined it."""
    from prefect_gpu_budget.units import validate_scope

    classes = current_ledger().config.priority_classes(validate_scope(org, "org"))
    if as_json:
        typer.echo(json.dumps(classes, indent=2))
        return
    for c in classes:
        line = f"{c['value']:>6}  {c['name']:<24} {c['defined_by']}"
        console.print(f"{line}  {c['description']}".rstrip())


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
    from prefect_gpu_budget.models import PoolSettings

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
    from prefect_gpu_budget.pricing.catalog import default_catalog

    catalog = default_catalog()
    for instance in instance_type:  # a job of an unpriced type could never be quoted
        rows = [row for row in catalog.rows() if row.key == instance]
        if not any(row.priced for row in rows):  # a price for any provisioning will do
            # says why: the nearest known type, or the reason the catalog has no figure
            catalog.quote(instance, provisioning=rows[0].provisioning if rows else "on-demand")
    current_ledger().config.set_pool(
        block.pool()
    )  # its quotas stay: a concurrent `pool quota` survives
    console.print(f"pool {org}/{name}: {nodes} x {gpus_per_node} {gpu_model}".rstrip())


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
    from prefect_gpu_budget.admission.rules.quota import TeamQuota, proportional, team_setting
    from prefect_gpu_budget.models import TeamShare
    from prefect_gpu_budget.units import BudgetInputError, validate_scope

    org = org_of(validate_scope(team, "team"))
    share = TeamShare(
        team=team,
        gpus=gpus or 0,
        vcpu=vcpu,
        memory_gib=memory_gib,
        **{
            k: v
            for k, v in (("borrow_pct", borrow_pct), ("lend_pct", lend_pct), ("weight", weight))
            if v is not None
        },
    )
    given = {
        "borrow_pct": borrow_pct,
        "lend_pct": lend_pct,
        "weight": weight,
        **{
            name: team_setting(name, value)  # a one-line error before anything is written
            for name, value in (
                ("reclaim", reclaim),
                ("within_team", within_team),
                ("queueing", queueing),
            )
            if value is not None
        },
    }

    def make(target, current):
        base = current or TeamQuota(pool, team, (0, 0, 0))
        kept = {
            name: getattr(base, name) if given.get(name) is None else given[name]
            for name in ("borrow_pct", "lend_pct", "weight", "reclaim", "within_team", "queueing")
        }
        if gpus is not None:
            quota = proportional(target, gpus, share.vcpu, share.memory_gib)
        elif current is None:
            raise BudgetInputError("gpus", f"{team} has no quota in {org}/{pool} yet: give --gpus")
        else:  # only the options given change
            g, v, m = current.quota
            quota = (g, v if vcpu is None else vcpu, m if memory_gib is None else memory_gib)
        return TeamQuota(pool, team, quota, **kept)

    # read, change and write in one locked transaction: a concurrent change to another team's
    # quota, or to the pool, survives
    target, new = current_ledger().config.set_team_quota(org, pool, make, team=team)
    console.print(
        f"{team} in {org}/{pool}: {_res(new.quota, target.gpu_model)}, borrow {new.borrow_pct}%, "
        f"lend {new.lend_pct}%, weight {new.weight}; reclaim {new.reclaim}, within team "
        f"{new.within_team}, {new.queueing}"
    )
