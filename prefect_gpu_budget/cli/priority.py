"""`priority set`, `priority remove` and `priority list`: an org's own priority classes."""

from __future__ import annotations

import json

import typer

from prefect_gpu_budget.cli.common import console, current_ledger, fail

priority_app = typer.Typer(
    name="priority", help="An org's own priority classes.", no_args_is_help=True
)


@priority_app.command("set")
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


@priority_app.command("remove")
def priority_remove(org: str = typer.Argument(...), name: str = typer.Argument(...)) -> None:
    """Remove an org's own class (jobs already recorded keep their priority)."""
    if not current_ledger().config.remove_priority_class(org, name):
        fail(f"name: {org} has no priority class {name!r} of its own")
    console.print(f"priority class {name} of {org} removed")


@priority_app.command("list")
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
