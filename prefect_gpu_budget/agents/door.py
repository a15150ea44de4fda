"""The agents' door, free of any transport: what REST (`agents.gateway`) and MCP
(`agents.mcp`) both call, so neither reveals more than the other.

An agent holds its token and nothing else. `Door.caller` turns the token into the caller's
(session, grant), with the rate limits; every other call acts for that caller only: another
session's run or job is a 404 exactly like one that does not exist. What a call refuses is a
`Refused` carrying an HTTP status and a one-line detail, whichever door it came through.

Sweeps' results come from the ledger's database (`SweepRecords`), never from the worker's
files; runs and their states from the Prefect API, which the gateway reaches with its own
credentials.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from prefect_gpu_budget.admission.admin_settings import AgentLimits, limits_for
from prefect_gpu_budget.admission.ledger import FINAL, Ledger
from prefect_gpu_budget.admission.stopping import stop_sweep
from prefect_gpu_budget.agents.callers import Caller, CallerCheck, Refused
from prefect_gpu_budget.agents.limits import (
    STOPPED_BY_AGENT,
    agent_spec,
    runnable,
    stop_own_job,
)
from prefect_gpu_budget.agents.throttle import LocalStore, RedisStore, store
from prefect_gpu_budget.agents.views import (
    FINAL_RUN_STATES,
    budget_view,
    sweep_view,
    template_view,
    trial_number,
    trial_view,
)
from prefect_gpu_budget.job import one_line
from prefect_gpu_budget.placement.recorded import trial_job
from prefect_gpu_budget.settings import gateway_redis_url
from prefect_gpu_budget.units import BudgetInputError, micro_to_usd

DEPLOYMENT = "agent-sweep/agents"
SESSION_TAG = "gpu-budget-session:"
ACTIVE_RUN_STATES = ["SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"]
SERVED_WITHIN_S = 90.0
"""The agent deployment counts as served when something polled it this recently (a served
flow polls every 10 s by default; Prefect marks a deployment not ready after 60 s)."""
MAX_LONG_POLL_S = 30.0
"""The longest `wait_s` of a sweep read: it returns as soon as anything in it changed."""
LONG_POLL_STEP_S = 1.0
MIN_LONG_POLL_S = 2.0
"""A long poll answers a change no sooner than this (unless the sweep ended): a trial that
reports every 100 ms wakes its watching agent every 2 s, well within its calls a minute."""
LONG_POLLS = (2, 16)
"""At most this many sweep reads wait at once per grant, and in all: each waits in one of the
server's worker threads (anyio lends 40), so waiting agents never take the threads every other
call needs. A read past either bound answers at once, as if `wait_s` were 0."""
START_WAIT_S = 10.0
"""How long a start waits for another start of its session to finish, on this gateway or
another one sharing its throttles: two starts at once must not both count the session's sweeps
below `max_sweeps` and both start. Past it (or while the shared throttle is down): 429."""
MAX_PAGE = 1000
"""Most records of a learning curve in one page."""


class Door:
    """Every operation an agent has, for one ledger and one Prefect API (`prefect`: a sync
    Prefect client, set once the gateway has opened it). Its limits count in `throttles`,
    default PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL's Redis (shared with the other gateways that
    name it), else this process."""

    def __init__(
        self,
        ledger: Ledger,
        prefect: Any = None,
        deployment: str = DEPLOYMENT,
        throttles: LocalStore | RedisStore | None = None,
    ) -> None:
        self.ledger, self.prefect, self.deployment = ledger, prefect, deployment
        counts = throttles or store(gateway_redis_url())
        self.callers = CallerCheck(ledger, counts)
        self.long_polls = counts.slots("long-polls", *LONG_POLLS)
        self.starts = counts.slots("sweep-starts", 1, 1_000_000)
        """One start of a sweep per session at a time, across the gateways (`START_WAIT_S`)."""

    @property
    def records(self) -> Any:
        """The ledger's sweep records (`Ledger.sweeps`): what sweeps wrote, never the worker's
        files."""
        return self.ledger.sweeps

    # -- who calls --------------------------------------------------------------------------

    def caller(self, authorization: str | None, address: str) -> Caller:
        """The caller of a `Bearer` token from the client at `address` (`CallerCheck.caller`);
        401 for none or a bad one, 429 past the limits, with `Retry-After`."""
        return self.callers.caller(authorization, address)

    # -- sweeps -----------------------------------------------------------------------------

    def _checked(self, caller: Caller, spec: Any) -> tuple[Any, AgentLimits]:
        """The spec held to the caller's limits and to what the worker can run, and the
        limits; 422 else."""
        try:
            limits = limits_for(self.ledger.grants, caller.session)
            checked = agent_spec(
                spec, caller.session, limits, self.ledger.config.priority_values(caller.session)
            )
            runnable(checked)
        except (BudgetInputError, ValidationError, ValueError) as exc:
            raise Refused(422, one_line(exc)) from None
        return checked, limits

    def start_sweep(self, caller: Caller, spec: Any) -> dict[str, str]:
        """Start a sweep in the caller's session: 422 for a spec that breaks a limit or cannot
        run, 503 when nothing serves the agent deployment, 429 past the session's sweeps."""
        checked, limits = self._checked(caller, spec)
        from prefect.exceptions import ObjectNotFound

        try:
            target = self.prefect.read_deployment_by_name(self.deployment)
        except ObjectNotFound:
            raise Refused(
                503, f"{self.deployment} is not deployed: is its worker serving?"
            ) from None
        polled = target.last_polled
        if polled is None or _age_s(polled) > SERVED_WITHIN_S:
            raise Refused(
                503,
                f"nothing serves {self.deployment} (last polled "
                f"{'never' if polled is None else f'{_age_s(polled):.0f}s ago'}): "
                "start its worker (`prefect-gpu-budget serve`)",
            )
        self._start_turn(caller.session)  # one start at a time: the count holds
        try:
            running = self._active_sweeps(caller.session, target.id, limits.max_sweeps)
            if running >= limits.max_sweeps:
                raise Refused(
                    429,
                    f"{caller.session} runs {running} sweeps; its agents may run at most "
                    f"{limits.max_sweeps} at once",
                )
            run = self.prefect.create_flow_run_from_deployment(
                target.id,
                parameters={
                    "spec": checked.model_dump(mode="json"),
                    "session": caller.session,
                    "grant": caller.grant,
                },
                tags=[SESSION_TAG + caller.session],
            )
        finally:
            self.starts.give(caller.session)
        return {"run_id": str(run.id), "name": run.name}

    def _start_turn(self, session: str) -> None:
        """Wait for the session's one turn to start a sweep (`starts`); 429 after START_WAIT_S."""
        deadline = time.monotonic() + START_WAIT_S
        while not self.starts.take(session):
            if time.monotonic() > deadline:
                raise Refused(
                    429,
                    f"another start of a sweep of {session} is still under way; try again",
                    {"Retry-After": "1"},
                )
            time.sleep(0.05)

    def _active_sweeps(self, session: str, deployment_id: uuid.UUID, most: int) -> int:
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )

        runs = self.prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[SESSION_TAG + session]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=ACTIVE_RUN_STATES)),
            ),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            limit=most + 1,
        )
        return len(runs)

    def _own_run(self, caller: Caller, run_id: str) -> Any:
        """The flow run if it is the caller's agent sweep; 404 alike for absent and others'."""
        from prefect.exceptions import ObjectNotFound

        try:
            run = self.prefect.read_flow_run(uuid.UUID(run_id))
        except (ValueError, ObjectNotFound):
            run = None
        if run is None or (run.parameters or {}).get("session") != caller.session:
            raise Refused(404, f"no sweep {run_id[:36]!r} in {caller.session}")
        return run

    def sweep(self, caller: Caller, run_id: str, wait_s: float = 0) -> dict[str, Any]:
        """The caller's sweep: state, message, spend, every trial (parameters, state, metrics,
        cost, wait) and the best trial. With `wait_s` (at most MAX_LONG_POLL_S), answers as
        soon as anything in it changed, or when that time is up; at once when the grant (or
        the gateway) has LONG_POLLS reads waiting already."""
        first = view = self._sweep_view(self._own_run(caller, run_id), caller.session)
        wait_s = min(max(0.0, float(wait_s)), MAX_LONG_POLL_S)
        if wait_s <= 0 or view["state"] in FINAL_RUN_STATES:
            return view
        if not self.long_polls.take(caller.grant):
            return view
        try:
            began = time.monotonic()
            deadline, soonest = began + wait_s, began + MIN_LONG_POLL_S  # changes batched a little
            while time.monotonic() < deadline and view["state"] not in FINAL_RUN_STATES:
                time.sleep(min(LONG_POLL_STEP_S, max(0.0, deadline - time.monotonic())))
                view = self._sweep_view(self._own_run(caller, run_id), caller.session)
                if view != first and time.monotonic() >= soonest:
                    return view
            return view
        finally:
            self.long_polls.give(caller.grant)

    def _sweep_view(self, run: Any, session: str) -> dict[str, Any]:
        """The sweep as `sweep` answers it (`views.sweep_view`): its trials' records and the
        job of each trial in the ledger (`recorded.trial_job`: its latest place, costed for all).
        The run is read again when the records say the sweep was cancelled or ended and the run
        read before them does not: a cancel sets the run's state before its records, so the
        view never shows a cancelled sweep's run still running."""
        run_id = str(run.id)
        meta = self.records.sweep(run_id)
        recorded = {t["trial"]: t for t in self.records.trials(run_id)}
        parts: dict[int, list[dict[str, Any]]] = {}
        for row in self.ledger.views.jobs(session, flow_run_id=run_id):  # in request order
            trial = trial_number(row["name"])
            if trial is not None:
                parts.setdefault(trial, []).append(row)
        jobs = {trial: trial_job(rows) for trial, rows in parts.items()}
        cancelled = meta is None and self.records.cancelled(run_id)
        moved_on = cancelled or bool(meta and (meta["ended_at"] or meta["cancelled_at"]))
        if moved_on and not (run.state and (run.state.is_final() or run.state.is_cancelling())):
            run = self.prefect.read_flow_run(run.id)  # a cancel or an end landed between the reads
        return sweep_view(run, meta, recorded, jobs, cancelled)

    def trial_metrics(
        self, caller: Caller, run_id: str, trial: int, offset: int = 0, limit: int = 500
    ) -> dict[str, Any]:
        """A trial's reported records in order (its learning curve), a page at a time."""
        self._own_run(caller, run_id)
        known = {t["trial"] for t in self.records.trials(run_id)}
        if trial not in known:
            raise Refused(404, f"no trial {trial} in sweep {run_id[:36]}")
        offset, limit = max(0, int(offset)), min(max(1, int(limit)), MAX_PAGE)
        records = self.records.records(run_id, trial, offset, limit)
        return {
            "trial": trial,
            "offset": offset,
            "records": records,
            "next_offset": offset + len(records) if len(records) == limit else None,
        }

    def results(self, caller: Caller, run_id: str) -> list[dict[str, Any]]:
        """The sweep's trials table: the published one once it ended, else as it stands."""
        run = self._own_run(caller, run_id)
        published = self.records.output(run_id, "results.json")
        if published is not None:
            return json.loads(published[1])
        return [
            {
                "trial": t["trial"],
                **t["params"],
                **t["metrics"],
                "non_finite_dropped": t["non_finite_dropped"],
                "state": t["state"],
                "reason": t["reason"],
                "cost_usd": t["cost_usd"],
                "waited_s": t["waited_s"],
                "job_id": t["job_id"],
            }
            for t in self._sweep_view(run, caller.session)["trials"]
        ]

    def results_csv(self, caller: Caller, run_id: str) -> str:
        """`results` as a CSV table (REST's `?format=csv`, MCP's `format: csv`), no cell of
        it a spreadsheet formula (`csv_cells`)."""
        import pandas as pd

        from prefect_gpu_budget.csv_cells import to_csv

        return to_csv(pd.DataFrame(self.results(caller, run_id)))

    def plots(self, caller: Caller, run_id: str) -> list[str]:
        self._own_run(caller, run_id)
        return [n for n, kind in self.records.outputs(run_id).items() if kind == "image/png"]

    def plot(self, caller: Caller, run_id: str, name: str) -> bytes:
        self._own_run(caller, run_id)
        found = self.records.output(run_id, name)
        if found is None or found[0] != "image/png":
            raise Refused(404, f"no plot {name[:64]!r} in sweep {run_id[:36]} (yet)")
        return found[1]

    def summary(self, caller: Caller, run_id: str) -> str:
        self._own_run(caller, run_id)
        found = self.records.output(run_id, "summary.md")
        if found is None:
            raise Refused(404, f"sweep {run_id[:36]} has no summary yet: it is written at its end")
        return found[1].decode()

    # -- steering ---------------------------------------------------------------------------

    def cancel_job(self, caller: Caller, job_id: str) -> dict[str, str]:
        """Stop one of the caller's jobs: queued, it is cancelled; admitted or running, its
        holder stops it (SIGTERM, its kill grace, SIGKILL) and settles it for what it ran."""
        try:
            became = stop_own_job(self.ledger, job_id, caller.session)
        except LookupError:
            raise Refused(404, f"no job {job_id[:36]!r} in {caller.session}") from None
        except BudgetInputError as exc:
            raise Refused(409, str(exc)) from None
        return {"job_id": job_id, "state": became}

    def cancel_sweep(self, caller: Caller, run_id: str) -> dict[str, Any]:
        """Stop the caller's sweep: it starts no more trials, its queued ones are cancelled
        and its running ones stopped as `cancel_job` stops them."""
        run = self._own_run(caller, run_id)
        if not self.records.started(run_id) and run.state and not run.state.is_final():
            from prefect.states import Cancelled, Cancelling

            said = STOPPED_BY_AGENT  # as its trials' rows and runs say it
            if run.state.is_scheduled():  # no process has it: it never starts
                self.prefect.set_flow_run_state(run.id, Cancelled(message=said), force=True)
            else:  # a process may run it already: its worker stops that process, as Prefect's
                # own cancel does, and the sweep starts no trial meanwhile (cancelled below)
                self.prefect.set_flow_run_state(run.id, Cancelling(message=said))
        stopped = stop_sweep(self.ledger, run_id, caller.session, STOPPED_BY_AGENT)
        return {"run_id": run_id, **stopped}

    def forecast(self, caller: Caller, spec: Any) -> dict[str, Any]:
        """What the sweep would do under the caller's budgets now, before anything starts:
        `likely` (each trial as long as it last ran, else as the sweep's finished trials ran,
        else its expected_runtime) and `bound` (each trial to its max_runtime, as the gate reserves it),
        each with trials admitted, timed out and rejected, spend, makespan and waits; the
        top-level figures are the likely ones (`Forecast.as_dict`)."""
        from prefect_gpu_budget.sweeps.forecast import forecast

        return forecast(self._checked(caller, spec)[0], self.ledger).as_dict()

    def place(
        self,
        caller: Caller,
        accelerators: str,
        nodes: int = 1,
        hours: float = 1.0,
        deadline_h: float | None = None,
        max_wait_h: float | None = None,
        resumable: bool = False,
    ) -> dict[str, Any]:
        """Where a job asking for `accelerators` would be placed in this session now, on the
        launchers its team's agents may use: every offering considered, the chosen one first
        among those that fit; nothing reserved."""
        from prefect_gpu_budget.job import GpuJob
        from prefect_gpu_budget.placement.placing import place_job

        try:
            job = GpuJob(
                accelerators=accelerators,
                nodes=nodes,
                max_runtime=float(hours) * 3600,
                deadline=None if deadline_h is None else float(deadline_h) * 3600,
                max_wait=None if max_wait_h is None else float(max_wait_h) * 3600,
                checkpoint="(resumable)" if resumable else None,
            )
            allowed = limits_for(self.ledger.grants, caller.session).launchers
            placed = place_job(job, caller.session, self.ledger, allowed=allowed)
        except (BudgetInputError, ValidationError, ValueError, TypeError) as exc:
            raise Refused(422, one_line(exc)) from None
        chosen = placed.placement.chosen.as_dict()
        return {"chosen": chosen, "considered": [c.as_dict() for c in placed.placement.considered]}

    def quote(
        self,
        instance_type: str,
        nodes: int = 1,
        hours: float = 1.0,
        provisioning: str = "on-demand",
    ) -> dict[str, Any]:
        """The catalog price of a job shape for `hours`."""
        from prefect_gpu_budget.admission.prices import default_catalog
        from prefect_gpu_budget.units import cost_micro

        try:
            if not 1 <= int(nodes) <= 1024:
                raise BudgetInputError("nodes", f"must be 1..1024, got {nodes}")
            if not 0 < float(hours) <= 24 * 366:
                raise BudgetInputError("hours", f"must be above 0 and at most a year, got {hours}")
            q = default_catalog().quote(instance_type, int(nodes), provisioning)
        except (BudgetInputError, ValueError, TypeError) as exc:
            raise Refused(422, one_line(exc)) from None
        return {
            "instance_type": q.row.key,
            "provisioning": provisioning,
            "nodes": int(nodes),
            "usd_per_hour": micro_to_usd(q.rate_micro_per_hour),
            "hours": float(hours),
            "usd": micro_to_usd(
                cost_micro(q.rate_micro_per_hour, float(hours) * 3600, round_up=True)
            ),
            "gpus_per_node": q.row.gpus,
            "gpu_model": q.row.gpu_model,
            "source": q.row.source,
            "as_of": str(q.row.as_of),
            "bound": q.bound,
            "warnings": list(q.warnings),
        }

    def status(self, caller: Caller) -> dict[str, Any]:
        """The caller's session: its budget and spend (`views.budget_view`: named as `status
        --json` names them), and its jobs not yet ended."""
        scope = caller.session
        budgets = [
            budget_view(row) for row in self.ledger.views.status(scope) if row["scope"] == scope
        ]
        if not budgets:  # no job yet: the team's template is what its first job will get
            team = scope.rsplit("/", 1)[0]
            budgets = [
                template_view(rule, scope)
                for rule in self.ledger.config.session_templates()
                if rule.scope == team
            ]
        live = [
            trial_view(trial_number(r["name"]), None, r)
            for r in self.ledger.views.jobs(scope, limit=500)
            if r["state"] not in FINAL
        ]
        return {"session": scope, "budget": budgets[0] if budgets else None, "jobs": live}


def _age_s(moment: datetime) -> float:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - moment).total_seconds()
