"""Soak: many agents in separate processes submit, cancel and finish GPU jobs for a long time.

Each agent is its own process with its own session scope `soak/team-<k>/agent-<i>` under
nested budgets (hourly caps on session, team and org, carried by Prefect global concurrency
limits; day, week and month budgets in the ledger on PostgreSQL), and loops through a mix of
jobs against the real `Gate`:

- run (55%): admitted, started, finished after 0.2-2 s and settled, through the job's life that
  `run_gpu_job` runs (`admission/lifecycle.py`: start recorded, settled once);
- impatient (15%): its own max_wait of 0.1-0.6 s; times out if it waits longer, else runs;
- interrupted (20%): a cancellation (an exception raised by a timer signal, like Ctrl-C or a
  task time-out) arrives 0.05-0.6 s after it starts waiting; it runs if admitted before that;
- withdrawn (10%): admitted, then cancelled before it starts.

Each agent keeps up to 3 jobs in flight and thinks 0-1.5 s between submissions; the session cap
holds 2 jobs, the team and org caps less than the sessions under them together, so some jobs
wait, at every level. Period budgets are sized never to bind (a budget running out would make
the end of the run unlike its start), but every decision reads them. A job still waiting 30 s
after the run ended is cancelled and counted as stuck.

Measured:
- admission latency: wall time of `Gate.admit` for jobs admitted at their first decision (they
  never waited): the ledger records and decides the request in one transaction, the Prefect
  limits of every capped scope on the path are taken in one request, the lease is recorded and
  the heartbeat starts. Waiting is workload, not gate cost, so jobs that waited are reported
  apart: from the start of the call that told them of their admission (their own
  `try_admit`, or their watcher's read of another transaction's decision) to admit's return.
  Also, every ledger decision (`ask`, `try_admit`) and every Prefect acquisition (granted or
  refused).
- per agent every 1-5 s: RSS (VmRSS), OS threads, open file descriptors and the ledger's
  SQLAlchemy pool (idle + checked out, filled to its steady size before the clock starts); from
  the parent: PostgreSQL backends with application_name `prefect-gpu-budget` in the soak
  database, and the Prefect server's RSS; each minute, the host's CPU steal and the rows
  PostgreSQL read per committed transaction in each database (`host_and_db`), to tell a gate
  whose queries do more work over time from a host that slows under it.
- start and end windows: the first and last `--edge` fraction (default 10%) of the run after a
  warm-up (10% of the run, 5-60 s). A window's p95 is the median of the p95s of up to 5
  consecutive groups of at least 20 samples, so one noisy burst moves the figure little.
  Memory: median RSS in the end window minus that in the start window, per agent. Connections,
  descriptors and threads: the end window's median must not pass the first half's maximum.
- at the end: nothing left queued, admitted or running; every count the agents kept matches the
  ledger; settled spend per (scope, period) equals the sum of the settled jobs' costs; no job
  cost more than its reservation; hourly caps never exceeded over the whole run (from the
  ledger's timestamps); no slot left taken in any Prefect limit.

Exit status 0 when every target is met, 1 when one is missed (`missed` in the JSON names them).

PostgreSQL is expected at 127.0.0.1:5432. The ledger is a database of the run's own
(`gate_soak_<id>`, dropped at the end) unless `--url` or GATE_SOAK_PG_URL names one (created if
missing, its gate tables dropped and recreated, never dropped itself). The Prefect server is a
real `prefect server start --no-services` on a PostgreSQL database of its own on the same server
(`gate_soak_prefect_<id>`, dropped at the end; not SQLite: under this load a SQLite server
answers "database is locked" with 503s, and Prefect's client backs off 2 s or more, which would
be measured as gate latency). Without services it never repossesses expired leases, so a leaked
slot stays visible at the end.

Usage: python -m benchmarks.soak --minutes 30 [--agents 8] [--url URL] [--json] [--keep DIR]
Progress goes to stderr; the table (or, with --json, one JSON object) to stdout.

The package: `config` (settings, budgets), `agent` (one agent process), `jobs` and `recording`
(what an agent runs and measures), `agents` (the agent processes from the parent), `run` (the
parent's run), `checks` (the verdicts), `analysis` (the figures), `report` (the text).
"""

from prefect_gpu_budget.testing.servers import quiet_prefect

quiet_prefect()  # before any module of the soak imports Prefect
