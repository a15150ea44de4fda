"""The clocks of the liveness protocol, in one place, and how they bound each other.

A job's ledger row carries `heartbeat_at`, the last time its holder showed it was alive; a capped
job also holds Prefect concurrency slots under a lease that lapses unless renewed. The clocks
below decide when silence means "gone". Each line of the argument is a test
(tests/admission/test_timing.py).

A queued job:  RECHECK_S (3 s) < STALE_WAITER_S (30 s) < STALE_AFTER_S (120 s).

- The watcher of a live waiter's process stamps the row at least every `RECHECK_S` (the gate's
  default `recheck_s`) while the ledger answers; a decision made by another process's
  transaction never stamps it. Only a waiter silent for `STALE_WAITER_S`, many rechecks missed,
  stops holding its place against the jobs behind it (and cannot be admitted for a holder that
  may be gone); it keeps its row and is decided again when it comes back.
- Reconcile cancels a queued row only once its holder is dead on this host or has been silent
  for `STALE_AFTER_S` (its default `stale_after`): a waiter loses its place in the queue long
  before it loses its row.

An admitted job:  LIVENESS_S (5 s) < HEARTBEAT_S (15 s) < LEASE_S (60 s) < UNRECORDED_LEASE_S
(83 s) < STALE_AFTER_S (120 s).

- Its heartbeat stamps the row and renews the lease every `HEARTBEAT_S = LEASE_S / 4`: three
  beats in a row may fail before the lease can lapse under a live job.
- While a request for slots is outstanding (a slow Prefect API), another thread stamps the row
  every `LIVENESS_S`, more often than the heartbeat. The gate asks for slots only within
  `LIMIT_RETRY_S` of admission or `LIVENESS_S` of a stamp, and a lease lives `LEASE_S` past its
  grant, returned by the server's repossessor up to `REPOSSESS_S` later; so a crashed admission
  may hold slots under a lease it did not live to record for at most `UNRECORDED_LEASE_S` after
  the row's last stamp, and reconcile holds such a row open (its rate counted) until then.
- A holder that learns of its job's admission from another process's transaction stamps the
  row itself before it asks for slots, unless the admission's own stamp is under
  `FRESH_ADMISSION_S` old (`FRESH_ADMISSION_S` < `LIVENESS_S`): its requests then fall within
  `LIMIT_RETRY_S + LIVENESS_S` of that stamp, as after a stamp of its own.
- `STALE_AFTER_S` exceeds `UNRECORDED_LEASE_S` (and so `LEASE_S`): a silent holder on another
  host counts as gone only after any lease it took but did not record has expired, so a row
  reconcile finds by silence never waits for one; only a holder seen dead on this host can
  leave a row awaiting lease expiry. It also spans several heartbeats: a live holder is never
  taken for gone over one late beat. A smaller `stale_after` given to reconcile gives up these
  margins.
- A job whose holder is gone without a record is charged up to its last stamp plus one
  `HEARTBEAT_S`: the last moment it could have been seen alive.

The patience values (`REQUEST_PATIENCE_S`, `GIVE_BACK_S`, `RELEASE_PATIENCE_S`,
`SETTLE_PATIENCE_S`) bound how long a caller keeps retrying a dependency that is down, not the
clocks above: a row whose holder is busy retrying is judged by the same stamps as any other, and
whatever reconcile does meanwhile, a job settles exactly once.

No imports: this module is read by the ledger, the gate, the Prefect limits and reconcile alike.
"""

from __future__ import annotations

LEASE_S = 60.0
"""The shortest lease Prefect grants; the heartbeat renews it every `LEASE_S / 4` seconds."""

HEARTBEAT_S = LEASE_S / 4
"""How often an admitted job's holder stamps its row and renews its lease (the gate's default
`heartbeat_s`); reconcile charges a job gone without a record up to its last stamp plus this."""

RECHECK_S = 3.0
"""How often a process's watcher re-decides each org its jobs wait in and stamps their rows,
whatever notices it heard (the gate's default `recheck_s`)."""

WAKE_ANYWAY_S = 300.0
"""The longest a waiting job sleeps without re-deciding itself, should its watcher never wake
it (every notice lost and every recheck failed)."""

STALE_WAITER_S = 30.0
"""A queued job whose waiter has not polled for this long no longer holds its place."""

LIMIT_RETRY_S = 3.0
"""How long an admitted job retries Prefect limits still held by a job that just settled."""

LIVENESS_S = 5.0
"""While a request for Prefect slots is outstanding (a slow or returning Prefect API), the job's
ledger row is stamped this often: reconcile counts a lease that a crashed admission may have
been granted but not recorded from the last stamp (`UNRECORDED_LEASE_S`)."""

FRESH_ADMISSION_S = 1.0
"""An admission whose row was stamped less than this long ago needs no stamp of its holder's
own before the holder asks for slots (less than `LIVENESS_S`, with room for hosts' clocks to
disagree by seconds)."""

REPOSSESS_S = 15.0
"""How late a Prefect server's repossessor may return the slots of an expired lease."""

LEASE_MARGIN_S = 10.0
"""Another process gives a silent holder's lease back only while the lease has at least this long
to live (its last renewal followed the row's last stamp): Prefect's release and its repossessor
each read a lease, decrement its slots, then revoke it, so the two at once count the slots back
twice and Prefect then lets a scope run past its cap. A lease nearer its end is left to lapse."""

UNRECORDED_LEASE_S = LIMIT_RETRY_S + LIVENESS_S + LEASE_S + REPOSSESS_S
"""After its row's last stamp (admission, or the stamps of a slow request for slots), how long a
crashed job may still hold Prefect slots under a lease it took but did not live to record: the
ledger keeps counting its rate until then. The gate asks for slots only within LIMIT_RETRY_S of
admission or LIVENESS_S of a stamp, and a lease lives LEASE_S past its grant."""

STALE_AFTER_S = 120.0
"""Silence after which a holder on another host counts as gone (reconcile's and the audit's
default `stale_after`)."""

REQUEST_PATIENCE_S = 300.0
"""How long a new request waits for a ledger that does not answer before it fails."""

GIVE_BACK_S = 60.0
"""How long a cancelled admission keeps trying to give the job back (the ledger or the Prefect
API down), and how long its caller waits for that before it re-raises."""

RELEASE_PATIENCE_S = 120.0
"""How long settlement keeps trying to give a job's Prefect slots back while the Prefect API is
down, before it settles the ledger anyway (the lease then lapses on its own)."""

SETTLE_PATIENCE_S = 900.0
"""How long settlement keeps trying while the ledger is down before it gives up (the record
then stays open for reconcile: nothing is lost)."""
