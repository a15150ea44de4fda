"""The agents' operations, each named and described once: its MCP tool, its REST route and what
it does. The gateway's routes take their OpenAPI summary and description from here, the MCP
tools their description (`agents.routes`, `agents.mcp`), so that what an agent reads through
either door is what the door does (tests/agents hold each claim to the door's behaviour).

A description says what the operation does and answers, and when it refuses (REST's status,
MCP's tool error `"<status>: <detail>"`); each door names its own parameters (REST's `?wait=`,
MCP's `wait_s`) in their own descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prefect_gpu_budget.agents.door import MAX_LONG_POLL_S
from prefect_gpu_budget.agents.limits import STOPPED_BY_AGENT


@dataclass(frozen=True)
class Operation:
    """One thing an agent can do: its MCP `tool`, its REST `method` and `route`, a one-line
    `summary` and the `details` after it."""

    tool: str
    method: str
    route: str
    summary: str
    details: str = ""

    @property
    def description(self) -> str:
        """The summary and its details: the MCP tool's description, the route's in OpenAPI."""
        return f"{self.summary} {self.details}".strip()


OPERATIONS = (
    Operation(
        "start_sweep",
        "POST",
        "/v1/sweeps",
        "Start a sweep (a `gpu_sweep` spec) in this session: its run_id and name.",
        "422 names the field a spec breaks or what cannot run (an unknown instance type, a "
        "command the agent user cannot execute); 429 past the sweeps this session may run at "
        "once; 503 when nothing serves the agent deployment.",
    ),
    Operation(
        "get_sweep",
        "GET",
        "/v1/sweeps/{run_id}",
        "A sweep of this session: its state and message, spend, every trial's parameters, "
        "state, outcome, reason, metrics, cost and wait, and the best trial.",
        f"Given a wait (seconds, at most {MAX_LONG_POLL_S:.0f}) it long-polls: it answers as "
        "soon as anything in the sweep changed, or when the wait is up.",
    ),
    Operation(
        "get_trial_metrics",
        "GET",
        "/v1/sweeps/{run_id}/trials/{trial}/metrics",
        "A trial's reported records in order (its learning curve, while it runs too), a page "
        "from offset; next_offset is null at the end.",
    ),
    Operation(
        "get_results",
        "GET",
        "/v1/sweeps/{run_id}/results",
        "The sweep's trials table, one row per trial (parameters, metrics, state, reason, "
        "cost), as JSON or, with format csv, as CSV.",
        "The table the sweep published once it ended, else as it stands.",
    ),
    Operation(
        "list_plots",
        "GET",
        "/v1/sweeps/{run_id}/plots",
        "The names of the sweep's plots (for get_plot), published when it ends.",
    ),
    Operation(
        "get_plot",
        "GET",
        "/v1/sweeps/{run_id}/plots/{name}",
        "One of the sweep's plots, as a PNG image.",
        "404 until the sweep has published it.",
    ),
    Operation(
        "get_summary",
        "GET",
        "/v1/sweeps/{run_id}/summary",
        "The sweep's summary, in markdown.",
        "404 until it is written, at the sweep's end.",
    ),
    Operation(
        "cancel_job",
        "POST",
        "/v1/jobs/{job_id}/cancel",
        "Stop one of this session's jobs, queued or running.",
        "A queued job is cancelled (state `cancelled`, nothing spent); an admitted or running "
        "one is stopped (state `stopping`: SIGTERM, its kill grace, SIGKILL) and settled for "
        f"what it ran, outcome `cancelled`, reason `{STOPPED_BY_AGENT}`. 409 once it has "
        "ended.",
    ),
    Operation(
        "cancel_sweep",
        "POST",
        "/v1/sweeps/{run_id}/cancel",
        "Stop a sweep of this session, at any time: it starts no more trials, its queued "
        "trials are cancelled and its running ones stopped as cancel_job stops them.",
        "Answers how many were cancelled and how many are stopping.",
    ),
    Operation(
        "forecast_sweep",
        "POST",
        "/v1/forecast",
        "What a sweep spec would do under this session's budgets now, without starting or "
        "reserving anything.",
        "Trials admitted, timed out and rejected, spend, makespan (to the last admitted "
        "trial's end), `end_s` (when the sweep is over, its time-outs' waits counted) and what "
        "binds: `likely` (each trial as long as it last ran, else as the sweep's finished "
        "trials ran, else its expected_runtime; also the top-level figures) and `bound` (each "
        "trial to its max_runtime, as the gate reserves it); in both each trial starts "
        "`start_s` after its admission (`start_from` says where that figure comes from).",
    ),
    Operation(
        "quote",
        "GET",
        "/v1/quote",
        "The catalog price of `nodes` machines of an instance type for `hours`, under "
        "`provisioning` (on-demand, spot or flex-start).",
    ),
    Operation(
        "place",
        "GET",
        "/v1/placement",
        "Where a job asking for accelerators (`H100:8`, or `{H100:8, H200:8}`) would run in "
        "this session now: every offering of the saved launchers and pools, its price, "
        "expected cost, wait and end, the chosen one (the cheapest that fits this session's "
        "budgets, the max wait and the deadline) and why each other was passed over.",
        "Nothing is reserved. 422 for an accelerator no offering has, a count no machine "
        "holds, or a deadline none can meet (naming the closest).",
    ),
    Operation(
        "get_status",
        "GET",
        "/v1/status",
        "This session: its budget and spend, as `prefect-gpu-budget status --json` names "
        "them, and its jobs not yet ended.",
    ),
)
"""Every operation an agent has, in the order the doors list them."""

BY_TOOL = {op.tool: op for op in OPERATIONS}

ResultsFormat = Literal["json", "csv"]
"""How `get_results` answers: JSON records, or the CSV table."""
