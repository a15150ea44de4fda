"""`agent grant`, `revoke`, `limits` and `serve`: agents' tokens, their ceilings, their gateway."""

from __future__ import annotations

import json

import typer

from prefect_gpu_budget.cli.common import console, current_ledger, fail


def agent_grant(
    scope: str = typer.Argument(..., help="The agent's session, org/team/session."),
) -> None:
    """Print a new token for an agent: with it, the agent gateway lets it run sweeps and cancel
    jobs in this session only. Shown once; only its hash is stored. The session needs a budget
    of its own or its team's session template."""
    typer.echo(current_ledger().grant_agent(scope))


def agent_revoke(
    scope: str = typer.Argument(..., help="The session whose tokens to revoke."),
) -> None:
    """Revoke every token granted for a session and cancel its queued jobs at once; its
    running sweeps admit nothing more (running jobs finish)."""
    from prefect_gpu_budget.units import validate_scope

    revoked, cancelled = current_ledger().revoke_agent(validate_scope(scope))
    if not revoked:
        fail(f"scope: no live agent token for {scope!r} (unknown session, or revoked already)")
    console.print(f"{revoked} token(s) revoked for {scope}; {cancelled} queued job(s) cancelled")


def agent_limits_cmd(
    team: str = typer.Argument(..., help="The team, org/team, whose sessions' agents to bound."),
    launcher: list[str] = typer.Option(
        None, help="A launcher agents may name: 'local' or 'kind:block' (repeat; default local)."
    ),
    callable_: list[str] = typer.Option(
        None, "--callable", help="A 'module:function' trial agents may call (repeat)."
    ),
    max_priority: int = typer.Option(None, help="Highest priority an agent's job may ask for."),
    max_wait: str = typer.Option(None, help="Longest max_wait an agent's job may ask for."),
    max_sweeps: int = typer.Option(None, help="Sweeps a session may run at once."),
    max_queued: int = typer.Option(None, help="Jobs a session may have queued at once."),
    max_trials: int = typer.Option(None, help="Trials in one sweep."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show, or change, the ceilings on what a team's agents may ask for (the defaults until
    set: local launcher only, no callables, priority 0, max_wait 1h, 2 sweeps, 16 queued jobs,
    100 trials a sweep)."""
    from prefect_gpu_budget.models import AgentLimits
    from prefect_gpu_budget.units import validate_scope

    led = current_ledger()
    team = validate_scope(team)
    given = {
        "launchers": launcher or None,
        "callables": callable_ or None,
        "max_priority": max_priority,
        "max_wait": max_wait,
        "max_sweeps": max_sweeps,
        "max_queued": max_queued,
        "max_trials": max_trials,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    limits = AgentLimits(team=team, **{**(led.agent_limits(team) or {}), **changes})
    if changes:
        led.set_agent_limits(team, limits.stored())
    if as_json:
        typer.echo(json.dumps(limits.model_dump(mode="json")))
        return
    for key, value in limits.model_dump(mode="json").items():
        console.print(f"{key}: {', '.join(value) if isinstance(value, list) else value}")


def agents_serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on."),
) -> None:
    """Run the agent gateway: the HTTP API agents use with their token (OpenAPI at /docs).
    It starts sweeps on the Prefect API of this process's settings, which agents must not
    reach: close that server with PREFECT_SERVER_API_AUTH_STRING and give this process
    PREFECT_API_AUTH_STRING."""
    from prefect_gpu_budget.agents.gateway import serve as serve_gateway

    serve_gateway(host, port)
