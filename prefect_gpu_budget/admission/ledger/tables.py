"""The ledger's tables, and the life of a job's row in `gpu_jobs`.

Each job is one row from request to settlement. Its `state` changes in one transaction that
checks the state it changes from (a job that moved on meanwhile is left as it is):

    queued --> admitted --> running --> settled
      |          |   |                     ^
      |          |   +---------------------+  (settled unstarted: cancelled, reconciled)
      |          +--> queued | cancelled      (`unadmit`: it could not start; keeps its place)
      +--> rejected | timed_out | cancelled   (the unrun endings)

- queued -> admitted: a decision admits it (its own, or another job's transaction deciding the
  org's queue), with its reservation.
- queued -> rejected / timed_out: the decision refuses it, or its max wait ran out; rejected
  also when an agent's job may not even queue (`agents.grant_refusal`).
- queued -> cancelled (or timed_out): `cancel_queued`, and `revoke_agent` for a session's jobs.
- admitted -> queued: `unadmit` (its Prefect concurrency slots could not be taken), or
  cancelled if its owner asked it to stop meanwhile; with `end`, admitted -> rejected or
  timed_out in the same transaction.
- admitted -> running: `mark_started` (False, and nothing written, once it is not admitted).
- admitted or running: `ask_stop` marks it (`stop_asked_at`); its holder stops it and
  settles it for what it ran.
- admitted or running -> settled: `settle`, exactly once (its actual cost replaces the
  reservation); reconcile settles an admitted job whose holder is gone, at zero.

`ACTIVE` states hold a reservation; `FINAL` ones never change again. An unrun ending
(`ended_unrun`) is settled at once, at no cost. Settled spend is also summed per (scope,
period) in `gpu_period_spend`, so a decision reads a few rows however long the ledger grows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa

ACTIVE = ("admitted", "running")
PREEMPTED, STOPPED = "preempted", "stopped"
"""Why a running job is asked to stop (`stop_asked`): preempted (a job of higher claim takes
its capacity: a lender reclaiming what it lent, or its own team's higher-priority work, as the
team's preemption settings allow), or its owner stopped it."""
FINAL = ("settled", "rejected", "timed_out", "cancelled")


metadata = sa.MetaData()


def _budget_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        metadata,
        sa.Column("scope", sa.String(160), primary_key=True),
        sa.Column("org", sa.String(48), nullable=False, index=True),
        sa.Column("hourly_cap_cents", sa.BigInteger),
        sa.Column("period_budget_micro", sa.BigInteger),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("on_limit", sa.String(8), nullable=False),
        sa.Column("max_wait_s", sa.Float, nullable=False),
        sa.Column("reservation_mode", sa.String(12), nullable=False),
        sa.Column("notify_block", sa.String(200)),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


budgets = _budget_table("gpu_budgets")
templates = _budget_table("gpu_session_templates")
"""Keyed by a team scope: the budget each of its sessions gets when it first asks for a job."""

jobs = sa.Table(
    "gpu_jobs",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("org", sa.String(48), nullable=False),
    sa.Column("scope", sa.String(160), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("instance_type", sa.String(120), nullable=False),
    sa.Column("provisioning", sa.String(16), nullable=False),
    sa.Column("nodes", sa.Integer, nullable=False),
    sa.Column("rate_micro_per_hour", sa.BigInteger, nullable=False),
    sa.Column("rate_cents", sa.BigInteger, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("max_runtime_s", sa.Float, nullable=False),
    sa.Column("expected_runtime_s", sa.Float),
    sa.Column("on_limit", sa.String(8)),
    sa.Column("max_wait_s", sa.Float),
    sa.Column("state", sa.String(12), nullable=False),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("reserved_micro", sa.BigInteger, nullable=False, default=0),
    sa.Column("reserve_seconds", sa.Float, nullable=False, default=0.0),
    sa.Column("actual_micro", sa.BigInteger),
    sa.Column("billed_seconds", sa.Float),
    sa.Column("outcome", sa.String(16)),
    sa.Column("requested_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),
    sa.Column("admitted_at", sa.Float),
    sa.Column("started_at", sa.Float),
    sa.Column("ended_at", sa.Float),
    sa.Column("settled_at", sa.Float),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("launcher", sa.String(200), nullable=False, default="local"),
    sa.Column("external_id", sa.String(200)),
    sa.Column("lease_id", sa.String(64)),
    sa.Column("flow_run_id", sa.String(36)),
    sa.Column("pool", sa.String(48)),
    sa.Column("team", sa.String(100)),
    sa.Column("node_gpus", sa.Integer),
    sa.Column("node_vcpu", sa.Integer),
    sa.Column("node_memory_gib", sa.Integer),
    sa.Column("placement", sa.String(400)),
    sa.Column("preempt_at", sa.Float),
    sa.Column("stop_asked_at", sa.Float),
    sa.Column("wait_key", sa.String(200)),
    sa.Column("wait_since", sa.Float),
    sa.Column("waits", sa.Text),
    sa.Column("choice", sa.Text),  # how the gate placed a job asking for accelerators (JSON)
    sa.Index("ix_gpu_jobs_org_state", "org", "state"),
    sa.Index("ix_gpu_jobs_org_settled", "org", "state", "settled_at"),
    sa.Index("ix_gpu_jobs_scope_ended", "scope", "ended_at"),
    sa.Index("ix_gpu_jobs_requested", "requested_at"),
    sa.Index("ix_gpu_jobs_flow_run", "flow_run_id"),
    sa.Index("ix_gpu_jobs_state_requested", "state", "requested_at"),
    sa.Index("ix_gpu_jobs_ended", "ended_at"),
    sa.Index("ix_gpu_jobs_team_requested", "team", "requested_at"),
)
"""Besides the decision's indexes (an org's open and settled jobs), the reads' own: the open
jobs of every org in request order (`state`, `requested_at`: what waits, orphans) and a
window of ended jobs (`ended_at`: the spend report's), neither reading a year of history."""

period_spend = sa.Table(
    "gpu_period_spend",
    metadata,
    sa.Column("scope", sa.String(160), primary_key=True),
    sa.Column("period_start", sa.Float, primary_key=True),
    sa.Column("period_end", sa.Float, nullable=False),
    sa.Column("settled_micro", sa.BigInteger, nullable=False),
)

pools = sa.Table(
    "gpu_pools",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("name", sa.String(48), primary_key=True),
    sa.Column("nodes", sa.Integer, nullable=False),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("vcpu", sa.Integer, nullable=False),
    sa.Column("memory_gib", sa.Integer, nullable=False),
    sa.Column("gpu_model", sa.String(64), nullable=False, default=""),
    sa.Column("instance_types", sa.Text, nullable=False, default=""),
    sa.Column("kind", sa.String(12), nullable=False, default="inventory"),
    sa.Column("backfill", sa.Boolean, nullable=False, default=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
"""What can run at once in an org: machines of one shape, or a cloud quota."""

team_quotas = sa.Table(
    "gpu_team_quotas",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("pool", sa.String(48), primary_key=True),
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("vcpu", sa.Integer, nullable=False),
    sa.Column("memory_gib", sa.Integer, nullable=False),
    sa.Column("borrow_pct", sa.Integer, nullable=False),
    sa.Column("lend_pct", sa.Integer, nullable=False),
    sa.Column("weight", sa.Integer, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("reclaim", sa.String(16)),
    sa.Column("within_team", sa.String(16)),
    sa.Column("queueing", sa.String(16)),
)
"""A team's share of a pool: its nominal quota, lending and borrowing, fair-share weight, and its
preemption and queueing settings (NULL: the default, `quota.TeamQuota`'s)."""

agent_grants = sa.Table(
    "gpu_agent_grants",
    metadata,
    sa.Column("token_sha256", sa.String(64), primary_key=True),
    sa.Column("scope", sa.String(160), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
)
"""An agent's token (only its hash is kept) binds it to one session scope. The hash is the
grant's id: what an agent's sweep carries instead of the token."""

agent_limits = sa.Table(
    "gpu_agent_limits",
    metadata,
    sa.Column("team", sa.String(120), primary_key=True),
    sa.Column("org", sa.String(48), nullable=False),
    sa.Column("limits", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
"""Keyed by a team scope, like the session template: an admin's ceilings (JSON, validated by
`models.AgentLimits`) on what the agents of the team's sessions may ask for."""

priority_classes = sa.Table(
    "gpu_priority_classes",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("value", sa.Integer, nullable=False),
    sa.Column("description", sa.String(200), nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
"""An org's own priority classes, as Kueue's WorkloadPriorityClass objects: a job naming one
gets its value when it is recorded (see `priorities`)."""

sweeps = sa.Table(
    "gpu_sweeps",
    metadata,
    sa.Column("run_id", sa.String(36), primary_key=True),
    sa.Column("scope", sa.String(160), nullable=False, index=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("metric", sa.String(200), nullable=False),
    sa.Column("goal", sa.String(4), nullable=False),
    sa.Column("trials", sa.Integer, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("ended_at", sa.Float),
    sa.Column("cancelled_at", sa.Float),
    sa.Column("message", sa.Text, nullable=False, default=""),
)
"""One row per sweep (keyed by its flow run): what it searches for, and whether it was asked
to stop. With `sweep_trials`, `trial_metrics` and `sweep_outputs`, a sweep's results live in the
ledger's database, where the agent gateway reads them from any host."""

sweep_trials = sa.Table(
    "gpu_sweep_trials",
    metadata,
    sa.Column("run_id", sa.String(36), primary_key=True),
    sa.Column("trial", sa.Integer, primary_key=True),
    sa.Column("params", sa.Text, nullable=False),
    sa.Column("metrics", sa.Text, nullable=False, default="{}"),
    sa.Column("records", sa.Integer, nullable=False, default=0),
    sa.Column("state", sa.String(40)),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("non_finite", sa.Integer),
)
"""A trial's parameters, its latest metrics (the summary, else the last record), how many
records it reported, how many NaN and infinite values it reported (left out: `trial_records.keep`;
null in a row an earlier version made, read as 0), and the name of its run's final state once
it ended."""

trial_metrics = sa.Table(
    "gpu_trial_metrics",
    metadata,
    sa.Column("run_id", sa.String(36), primary_key=True),
    sa.Column("trial", sa.Integer, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("record", sa.Text, nullable=False),
)
"""Each record a trial reported, in order: its learning curve."""

sweep_outputs = sa.Table(
    "gpu_sweep_outputs",
    metadata,
    sa.Column("run_id", sa.String(36), primary_key=True),
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("media_type", sa.String(40), nullable=False),
    sa.Column("content", sa.LargeBinary, nullable=False),
)
"""A sweep's published outputs: its results table (JSON), summary (markdown) and plots (PNG)."""

bill_imports = sa.Table(
    "gpu_bill_imports",
    metadata,
    sa.Column("source", sa.String(16), primary_key=True),
    sa.Column("billing_period", sa.String(7), primary_key=True),
    sa.Column("imported_at", sa.Float, nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("lines", sa.Integer, nullable=False),
    sa.Column("read_from", sa.Text, nullable=False),
)
"""The last import of each (source, billing period): what it was read from, and a digest of
its lines (a second import of the same export is known as such)."""

bill_lines = sa.Table(
    "gpu_bill_lines",
    metadata,
    sa.Column("source", sa.String(16), primary_key=True),
    sa.Column("billing_period", sa.String(7), primary_key=True),
    sa.Column("line_id", sa.String(400), primary_key=True),
    sa.Column("job_id", sa.String(36)),
    sa.Column("kind", sa.String(10), nullable=False),
    sa.Column("line_type", sa.String(60), nullable=False),
    sa.Column("usage_start", sa.Float, nullable=False),
    sa.Column("usage_end", sa.Float, nullable=False),
    sa.Column("billed_micro", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(8), nullable=False),
    sa.Column("mark", sa.String(200)),
    sa.Column("resource_id", sa.String(400)),
    sa.Column("description", sa.String(400), nullable=False, default=""),
    sa.Column("reason", sa.Text),
    sa.Index("ix_gpu_bill_lines_job", "job_id"),
    sa.Index("ix_gpu_bill_lines_identity", "source", "line_id"),
)
"""Every line of the imported bills: `kind` `job` (it bills a ledger job: `job_id`),
`untagged` (usage no job's mark names), `account` (a tax, fee, credit or refund of the
account), `refused` (it names a job it cannot be true of: `reason` says why) or `copy` (a
line already held under another billing period: `reason` names it); lines of every kind but
`job` are shown apart and never spread over scopes."""

bill_staged = sa.Table(
    "gpu_bill_staged",
    metadata,
    sa.Column("token", sa.String(36), primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("part", sa.Integer, nullable=False),
    sa.Column("staged_at", sa.Float, nullable=False),
    sa.Column("source", sa.String(16), nullable=False),
    sa.Column("billing_period", sa.String(7), nullable=False),
    sa.Column("line_id", sa.Text, nullable=False),
    sa.Column("repeat_id", sa.Text),
    sa.Column("numbered_id", sa.Text),
    sa.Column("kind", sa.String(10), nullable=False),
    sa.Column("job_id", sa.String(36)),
    sa.Column("line_type", sa.Text, nullable=False),
    sa.Column("usage_start", sa.Float, nullable=False),
    sa.Column("usage_end", sa.Float, nullable=False),
    sa.Column("billed_micro", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.Text, nullable=False),
    sa.Column("mark", sa.Text),
    sa.Column("resource_id", sa.Text),
    sa.Column("resource_name", sa.Text),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column("version", sa.Text, nullable=False),
    sa.Column("place", sa.Text, nullable=False),
    sa.Column("dup", sa.Boolean, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Index("ix_gpu_bill_staged_repeat", "token", "repeat_id"),
    sa.Index("ix_gpu_bill_staged_job", "token", "job_id"),
)
"""The lines of a bill being imported, staged batch by batch as they are read (`token` names
the import, `seq` a line's place in its read, `part` the read whose repeated ids are numbered
together), so that an import holds a batch in memory, not a month: the import then numbers,
classifies and swaps them into `bill_lines` in SQL, and deletes them. Values are as read
(`place`: the file and row; `repeat_id`: its id, on a line whose id repeats in its read;
`numbered_id`: the id it is numbered to), `dup` marks a line read again, `kind`/`job_id`/
`reason` end as `bill_lines` holds them. Its indexes are of columns empty as a line is staged
(none of `line_id`, whose values come in no order), so a batch costs no random index writes. Rows a crashed import left are deleted by the next, a day later."""

bill_jobs = sa.Table(
    "gpu_bill_jobs",
    metadata,
    sa.Column("job_id", sa.String(36), primary_key=True),
    sa.Column("org", sa.String(48), nullable=False),
    sa.Column("scope", sa.String(160), nullable=False),
    sa.Column("billed_micro", sa.BigInteger, nullable=False),
    sa.Column("final", sa.Boolean, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("held", sa.Boolean),
    sa.Column("reason", sa.Text),
)
"""Each job a bill names: what its lines bill in all, and whether that figure is final (its
settlement is replaced by its lines in the periods: `billing.trueup`), still provisional, or
`held` for an admin to accept; `reason` says why it is not final."""

bill_accepts = sa.Table(
    "gpu_bill_accepts",
    metadata,
    sa.Column("job_id", sa.String(36), primary_key=True),
    sa.Column("accepted_micro", sa.BigInteger, nullable=False),
    sa.Column("accepted_at", sa.Float, nullable=False),
)
"""The held figures an admin accepted: a job's bill up to `accepted_micro` books."""

over_by_bill = sa.Table(
    "gpu_over_by_bill",
    metadata,
    sa.Column("scope", sa.String(160), primary_key=True),
    sa.Column("period_start", sa.Float, primary_key=True),
    sa.Column("period_end", sa.Float, nullable=False),
    sa.Column("budget_micro", sa.BigInteger, nullable=False),
    sa.Column("spent_micro", sa.BigInteger, nullable=False),
    sa.Column("marked_at", sa.Float, nullable=False),
)
"""Closed periods whose spend, trued up from the bill, passed their budget."""

local_prices = sa.Table(
    "gpu_local_prices",
    metadata,
    sa.Column("name", sa.String(48), primary_key=True),
    sa.Column("usd_per_hour", sa.String(40), nullable=False),
    sa.Column("gpu_model", sa.String(64), nullable=False),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("vcpu", sa.Integer, nullable=False),
    sa.Column("memory_gib", sa.Integer, nullable=False),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("as_of", sa.String(10), nullable=False),
    sa.Column("set_at", sa.Float, nullable=False),
)
"""The prices of `local:NAME` machines (`prices set-local`): in the ledger, so that every host
and replica on it prices a local machine alike. The price is kept as its decimal text, exactly
as given; `as_of` is an ISO date."""

versions = sa.Table(
    "gpu_versions",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("version", sa.BigInteger, nullable=False),
)


schema = sa.Table("gpu_schema", metadata, sa.Column("digest", sa.String(64), primary_key=True))
"""The digests of the schemas this ledger has been brought up to."""
SCHEMA = hashlib.sha256(
    repr(
        sorted(
            (
                t.name,
                sorted((c.name, str(c.type)) for c in t.columns),
                sorted(i.name for i in t.indexes),
            )
            for t in metadata.sorted_tables
        )
    ).encode()
).hexdigest()
"""This version's schema, as a digest: its tables, columns and indexes."""


def ended_unrun(state: str, reason: str, now: float) -> dict[str, Any]:
    """The columns of a job that ends without running (rejected, timed out, cancelled): settled
    at once, at no cost."""
    return {"state": state, "ended_at": now, "settled_at": now, "actual_micro": 0, "reason": reason}
