"""Chaos: SIGKILL an admitter or a running job's holder at a random moment; afterwards, with
reconcile, nothing is lost.

Each run gives a fresh org a nested budget (hourly caps on the org, its team and each session,
so Prefect concurrency slots are taken; day and month period budgets) and starts WORKERS
admitter processes at once, each a real Gate with RateLimits against one Prefect server, each
running its job (`sleep`) with the LocalLauncher. One of them, the victim, is SIGKILLed at a
random moment of the run's phase (the runs cycle through PHASES):

- before_reserve: just before or while its ledger request commits;
- after_reserve: admitted by the ledger, before or while it takes and records its rate slots;
- running: while its job runs;
- settling: before, during or after handing the slots back, before or during the ledger
  settlement.

Every worker pauses PAUSE_S before each step of those phases (a slow machine) and tells the
parent through a pipe when each phase begins, so a kill delay drawn over the phase's usual
length (learned from the other workers) lands at every step. A fault counts as injected when
SIGKILL ended the victim while its last word was the run's phase. With --park-at, more runs
follow, each victim killed exactly at a step mark (`<acquire`: Prefect granted the lease, its
id not yet recorded; `<release`: the slots handed back, the ledger not yet settled).

After each run. Once the victim is dead, reconcile runs (as a scheduled reconcile would), the
other workers finish, reconcile runs again, and the run's org is audited with
`prefect_gpu_budget.admission.audit`. A victim killed between its admission and recording its
Prefect lease may hold slots nobody can hand back: Prefect has no API to find the lease, only
its expiry returns them. Reconcile keeps such a row open (`awaiting-lease-expiry`) so that the
ledger counts its rate as long as Prefect may count the slots; the difference this leaves when
Prefect never granted the lease is reported apart (`slot_mismatch_transient_cents`), not lost.

Faults that are not kills (--faults stall,escape; each run once per --fault-repeat): one job,
admitted by a Gate in this process, with max_runtime FAULT_MAX_RUNTIME_S and kill grace
FAULT_GRACE_S, its process tree watched from outside (by a marker in its environment):

- stall: another connection locks the ledger (SQLite `BEGIN IMMEDIATE`, PostgreSQL
  `LOCK TABLE gpu_jobs IN EXCLUSIVE MODE`) when the job starts, for longer than max_runtime plus
  grace; the job's start cannot be recorded, and it must still be stopped in time;
- escape: the job's command starts `nohup` and `setsid` children that outlive it and its
  max_runtime; they must be billed and stopped with the job.

For each: `overshoot_micro`, what its processes really ran (rate x their watched life) beyond
what it had reserved (guaranteed mode: max_runtime plus grace), and `unmetered_micro`, what
they ran beyond what was billed. Both must be 0; the tree must be gone afterwards
(`jobs_outlived_holder`).

At the end. Once every lease a dead worker may hold unrecorded has expired and the server's
repossessor has returned its slots (UNRECORDED_LEASE_S after the last stamp of such a row; polled, with
END_MARGIN_S to spare), reconcile runs again and the whole ledger is audited. These are the
figures: `orphans_left` (reservations without an owner), `double_charges` (and
`missing_charges`), `slot_mismatch_cents` (Prefect slots in use per capped scope against the
ledger's running rate, both 0 by then) and `invariant_violations` (promise 1 replayed over the
ledger's timestamps, so it held throughout). The same figures after each run's reconcile are
under `after_each_run`.

Workers are forked from a preloaded fork server, so each is a fresh process (its own pid, its
own Prefect client and database connections) without paying for the imports each time.

Usage: python -m benchmarks.chaos [--runs N] [--url SQLALCHEMY_URL] [--seed S] [--json]
                                 [--api-url PREFECT_API_URL] [--phases P1,P2]
                                 [--park-at MARK1,MARK2] [--faults stall,escape]
                                 [--fault-repeat R]

The ledger is a SQLite file in a temporary directory unless --url names one. A PostgreSQL
database is created if missing and its gate tables are dropped and recreated: give it its own
database (e.g. postgresql://postgres@127.0.0.1:5432/gate_chaos). The Prefect server is a
`prefect server start` of its own (a temporary PREFECT_HOME, durable filesystem lease storage,
its lease repossessor running) unless --api-url names a running one; that one must run the
repossessor too (the test harness and the ephemeral server do not), or the end-state slot
check fails. --phases limits the random runs to some phases; --park-at adds one run per step
mark after them (--runs 0: only those).
Progress goes to stderr; the table (or, with --json, one JSON object) to
stdout. Exit status 1 if anything was lost.

The package: `config` (settings, budgets), `worker` (the forked admitter), `kills` (one kill
run), `faults` (the stall and escape runs), `checks` (reconcile and the checks around it),
`end` (the wait for lease expiry and the final audit), `state` (what the runs share and find),
`summary` (the figures), `report` (the text), `campaign` (all of it in order).
"""

from prefect_gpu_budget.testing.servers import quiet_prefect

quiet_prefect()  # before any module of the campaign imports Prefect
