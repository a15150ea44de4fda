"""`agent grant`, `revoke`, `limits` and `serve`: agents' tokens, their ceilings, their gateway."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from prefect_gpu_budget.cli.common import (
    PASSWORD_ON_ARGV,
    console,
    current_ledger,
    fail,
    shown_url,
)
from prefect_gpu_budget.settings import ALLOW_SHARED_HOME_ENV, LEDGER_URL_ENV

agent_app = typer.Typer(
    name="agent",
    help="Agents: tokens that bind each to its own session, their limits, and their gateway.",
    no_args_is_help=True,
)


@agent_app.command("grant")
def agent_grant(
    scope: str = typer.Argument(..., help="The agent's session, org/team/session."),
) -> None:
    """Print a new token for an agent: with it, the agent gateway lets it run sweeps and cancel
    jobs in this session only. Shown once; only its hash is stored. The session needs a budget
    of its own or its team's session template."""
    typer.echo(current_ledger().grants.grant_agent(scope))


@agent_app.command("revoke")
def agent_revoke(
    scope: str = typer.Argument(..., help="The session whose tokens to revoke."),
) -> None:
    """Revoke every token granted for a session, cancel its queued jobs and stop its running
    ones at once (each settled for what it ran); its sweeps admit nothing more."""
    from prefect_gpu_budget.units import validate_scope

    revoked, cancelled, stopped = current_ledger().grants.revoke_agent(validate_scope(scope))
    if not revoked:
        fail(f"scope: no live agent token for {scope!r} (unknown session, or revoked already)")
    console.print(
        f"{revoked} token(s) revoked for {scope}; {cancelled} queued job(s) cancelled, "
        f"{stopped} running job(s) stopped"
    )


@agent_app.command("limits")
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
    from prefect_gpu_budget.admission.admin_settings import AgentLimits
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
    limits = AgentLimits(team=team, **{**(led.grants.agent_limits(team) or {}), **changes})
    if changes:
        led.grants.set_agent_limits(team, limits.stored())
    if as_json:
        typer.echo(json.dumps(limits.model_dump(mode="json")))
        return
    for key, value in limits.model_dump(mode="json").items():
        console.print(f"{key}: {', '.join(value) if isinstance(value, list) else value}")


def startup_check(url: str | None, allow_shared: bool) -> None:
    """`settings.check_private_state` for a command that serves: what this user owns and
    others can reach is made private, with one line on stderr each; another user's is refused
    (exit 2 with its one line) or, allowed, left as it is with a loud warning on stderr; and one
    line of warning when the ledger's database lets its user in without a password
    (`passwordless_login`)."""
    from prefect_gpu_budget import settings

    try:
        warning = settings.check_private_state(
            url, allow_shared, closed=lambda line: typer.echo(line, err=True)
        )
    except settings.SharedStateError as exc:
        fail(str(exc))
    if warning:
        typer.echo(f"WARNING: running with shared state, as allowed: {warning}", err=True)
    for line in _exposure_lines(settings.ledger_url(url), settings.agent_network()):
        typer.echo(line, err=True)


def _exposure_lines(url: str, network: str) -> list[str]:
    """One line when agents' jobs run on the host's network (`host`: what they then reach),
    and one when the ledger's PostgreSQL lets its user in without a password, naming each road
    (TCP, its unix socket), who can take it, and the fix."""
    from prefect_gpu_budget import settings
    from prefect_gpu_budget.admission.ledger.passwordless import (
        passwordless_login,
        passwordless_socket,
    )

    lines = []
    host = network == "host"
    if host:
        lines.append(
            f"WARNING: {settings.AGENT_NETWORK_ENV}=host: agents' jobs share this host's "
            "network, /run, /tmp and unix sockets, so they reach every port and socket their "
            "user may, the ledger's database and Prefect's API included"
        )
    tcp, socket = passwordless_login(url), passwordless_socket(url)
    if tcp or socket:
        roads = " and ".join(
            road for road in (tcp and "over TCP", socket and f"through its socket {socket}") if road
        )
        jobs = (
            "agents' jobs on the host's network reach it too"
            if host
            else "agents' jobs reach it by neither road (a network of their own, the host's "
            "sockets hidden)"
        )
        lines.append(
            f"WARNING: the ledger's database {tcp or shown_url(url)} let its user in without a "
            f"password {roads}: {jobs}, but any local process may rewrite every budget; use "
            "scram-sha-256 for its host lines and scram-sha-256 or peer for its local lines "
            "in pg_hba.conf, and put the password in the ledger URL"
        )
    return lines


def _serving_ledger_url(
    ctx: typer.Context, given: str | None, from_file: Path | None, allow_shared: bool
) -> str | None:
    """The ledger URL `agents serve` uses: its --ledger-url-file or --ledger-url, else the
    app's --ledger-url, else PREFECT_GPU_BUDGET_LEDGER_URL, else the default. A password typed
    on the command line is refused; so is one in a file other users can read."""
    from click.core import ParameterSource

    from prefect_gpu_budget import settings

    if given is not None and from_file is not None:
        fail("--ledger-url and --ledger-url-file: give one")
    if from_file is not None:
        try:
            text = from_file.read_text().strip()
            mode = from_file.stat().st_mode & 0o077
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"--ledger-url-file: cannot read {from_file} ({type(exc).__name__})")
        if not text or "\n" in text:
            fail(f"--ledger-url-file: {from_file} must hold one URL on one line")
        if (
            mode
            and settings.url_has_password(text)
            and not (allow_shared or settings.allow_shared_home())
        ):
            fail(
                f"--ledger-url-file: {from_file} holds a password and other users can read it "
                f"(mode {from_file.stat().st_mode & 0o777:04o}): chmod 600 {from_file}"
            )
        return text
    root = ctx.find_root()
    if given is None and root.get_parameter_source("ledger_url") == ParameterSource.COMMANDLINE:
        given = root.params.get("ledger_url")  # `prefect-gpu-budget --ledger-url URL agents serve`
    if given is not None and settings.url_has_password(given):
        fail(PASSWORD_ON_ARGV)
    return given or None


@agent_app.command("serve")
def agents_serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on."),
    ledger_url: str = typer.Option(
        None,
        "--ledger-url",
        help=f"Ledger database URL, without a password (one with a password: {LEDGER_URL_ENV} "
        "or --ledger-url-file).",
    ),
    ledger_url_file: Path = typer.Option(
        None,
        "--ledger-url-file",
        help="A file holding the ledger's URL on one line (mode 0600 if it has a password).",
    ),
    allow_shared_home: bool = typer.Option(
        False,
        "--allow-shared-home",
        help="Leave PREFECT_HOME and a SQLite ledger open to other users as they are, and "
        f"start (a loud warning instead; or {ALLOW_SHARED_HOME_ENV}=1).",
    ),
) -> None:
    """Run the agent gateway: the HTTP API agents use with their token (OpenAPI at /docs).
    It starts sweeps on the Prefect API of this process's settings, which agents must not
    reach: close that server with PREFECT_SERVER_API_AUTH_STRING and give this process
    PREFECT_API_AUTH_STRING. A PREFECT_HOME or SQLite ledger of this user's that other users
    can reach it makes private (one line says so); another user's it refuses to start with.
    Behind a proxy, name it in PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES: only
    its X-Forwarded-For is believed. Without PREFECT_API_URL it uses the temporary server of a
    `serve` on this PREFECT_HOME, else starts one of its own, stopped as it ends."""
    from prefect_gpu_budget import settings

    url = _serving_ledger_url(ctx, ledger_url, ledger_url_file, allow_shared_home)
    startup_check(url, allow_shared_home)
    try:
        trusted = settings.gateway_trusted_proxies()
    except ValueError as exc:
        fail(str(exc))
    from prefect_gpu_budget.cli.server import ensure_server

    ensure_server("agents serve")  # before Prefect is imported: its URL is read once
    from prefect_gpu_budget.agents.gateway import serve as serve_gateway

    serve_gateway(host, port, url, trusted_proxies=trusted)
