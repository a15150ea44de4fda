"""The fast path: an admission that fits is one ledger commit (request, decision and lease) and
its settlement one more, with no call to Prefect while the org's lock is held; and a SIGKILL on
either side of that commit leaves nothing reconcile and lease expiry do not clean up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.harness.commits import LedgerCounts
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger.settlement import HeldLease
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.support.jobs import new_job
from tests.support.limits import SlowLimits

JOB = GpuJob(instance_type="local:box", max_runtime="1m")  # 360 cents an hour


class _Watching(SlowLimits):
    """Prefect limits that answer at once and note a request for slots made while a thread of
    this process holds the org's lock (`OrgLock`, held as long as a write transaction of the org
    runs): a decision never waits for Prefect. (A settlement's release goes out beside its
    transaction, which does not wait for it: `Holding._settle`.)"""

    def __init__(self, ledger, org: str) -> None:
        super().__init__(delay=0.0)
        self.lock, self.under_lock = ledger.db._org_lock(org), []

    def _check(self, what: str) -> None:
        if self.lock._owner is not None:
            self.under_lock.append(what)

    def ensure(self, caps) -> None:
        self._check("ensure")

    def acquire(self, scopes, slots):
        self._check("acquire")
        return super().acquire(scopes, slots)


def _spent(counts: LedgerCounts, call) -> tuple[object, dict[str, int]]:
    before = counts.snapshot()
    out = call()
    after = counts.snapshot()
    return out, {k: after[k] - before[k] for k in ("commits", "org_locks")}


def test_an_admission_that_fits_is_one_commit_and_its_settlement_one(ledger, prices):
    ledger.config.set_budget(BudgetRule("one", hourly_cap_cents=3600))
    ledger.config.set_budget(BudgetRule("one/t", hourly_cap_cents=3600))
    limits = _Watching(ledger, "one")
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    counts = LedgerCounts(ledger.db.engine)
    try:
        # the scope's first job here: slots after the admission, the lease recorded apart
        first, cost = _spent(counts, lambda: gate.admit(JOB, "one/t/s"))
        assert cost == {"commits": 2, "org_locks": 2 if ledger.db.is_sqlite else 1}
        _, cost = _spent(
            counts,
            lambda: gate.holding.settle(first, ended_at=time.time(), outcome="completed"),
        )
        assert cost == {"commits": 1, "org_locks": 1}
        for _ in range(3):  # then each of its jobs: slots first, one commit
            admission, admitted = _spent(counts, lambda: gate.admit(JOB, "one/t/s"))
            row = ledger.views.job(admission.job_id)
            assert row["state"] == "admitted" and row["lease_id"] == admission.lease_id
            assert row["heartbeat_at"] <= row["admitted_at"]  # stamped when the lease was asked
            _, settled = _spent(
                counts,
                lambda a=admission: gate.holding.settle(
                    a, ended_at=time.time(), outcome="completed"
                ),
            )
            assert (admitted, settled) == ({"commits": 1, "org_locks": 1},) * 2
    finally:
        counts.close()
    assert limits.under_lock == []
    assert sorted(limits.released) == sorted(limits.taken)  # one lease a job, every one back
    assert len(limits.taken) == 4


def test_a_held_lease_is_recorded_only_with_an_admission_under_its_caps_while_fresh(ledger):
    ledger.config.set_budget(BudgetRule("held", hourly_cap_cents=720))  # two jobs of 360
    caps = (("held", 720),)

    def ask(job_id: str, lease: HeldLease) -> tuple[str, bool]:
        decision, _, recorded = ledger.queue.ask(new_job("held/t"), job_id, lease)
        return decision.verdict, recorded

    asked = time.time() - 0.5
    assert ask("a", HeldLease("lease-a", caps, 360, asked)) == ("admit", True)
    row = ledger.views.job("a")
    assert row["lease_id"] == "lease-a" and row["heartbeat_at"] == pytest.approx(asked)
    # caps that changed since the lease was taken, or other slots: the holder takes its own
    assert ask("b", HeldLease("lease-b", (("held", 360),), 360, time.time())) == ("admit", False)
    assert ledger.views.job("b")["lease_id"] is None
    # a job told to wait records nothing (its holder gives the lease back)
    assert ask("c", HeldLease("lease-c", caps, 360, time.time())) == ("wait", False)
    assert ledger.views.job("c")["lease_id"] is None
    for done in ("a", "b"):
        ledger.settlements.settle(done, ended_at=time.time(), outcome="completed", scope="held/t")
    assert ledger.views.job("c")["state"] == "admitted"  # by the settlements' transactions
    # a lease asked long before the transaction (a ledger slow to answer) is checked first
    stale = HeldLease("lease-d", caps, 360, time.time() - 10.0)
    assert ask("d", stale) == ("admit", False)
    assert ask("e", HeldLease("lease-e", caps, 360, time.time(), fresh_s=0.0)) == ("wait", False)


CRASHER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import Catalog

    url, prices, leases, point = sys.argv[1:5]

    class FileLimits:  # Prefect's leases, as a file: `+id` granted, `-id` released
        n = 0
        def ensure(self, caps): pass
        def acquire(self, scopes, slots):
            self.n += 1
            lease = f"lease-{self.n}"
            with open(leases, "a") as f:
                f.write(f"+{lease}\\n")
            return lease
        def renew(self, lease_id): return True
        def release(self, lease_id):
            with open(leases, "a") as f:
                f.write(f"-{lease_id}\\n")

    ledger = Ledger(url)
    gate = Gate(ledger, FileLimits(), catalog=Catalog.load(Path(prices)))
    job = GpuJob(instance_type="local:box", max_runtime="10m")
    first = gate.admit(job, "fast/t/s")
    gate.holding.settle(first, ended_at=time.time(), outcome="completed")
    ask = ledger.queue.ask

    def parked(new, job_id, lease=None):
        if point == "before-commit":
            assert lease is not None, "the fast path asks with its lease"
            print("parked", flush=True)
            time.sleep(600)
        out = ask(new, job_id, lease)
        assert out[2], "the lease was recorded with the admission"
        print("parked", flush=True)
        time.sleep(600)

    ledger.queue.ask = parked
    gate.admit(job, "fast/t/s")
    """
)


class _Released:
    """What reconcile gives back to Prefect."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)


@pytest.mark.parametrize("point", ["before-commit", "after-commit"])
def test_sigkill_on_either_side_of_the_one_commit(ledger, ledger_url, prices, tmp_path, point):
    ledger.config.set_budget(
        BudgetRule("fast", hourly_cap_cents=10_000, period_budget_micro=50_000_000)
    )
    ledger.config.set_budget(BudgetRule("fast/t"))
    leases = tmp_path / "leases"
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, ledger_url, str(prices), str(leases), point],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "parked"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # the first job's lease went back; the second was granted and never given back
    assert leases.read_text().split() == ["+lease-1", "-lease-1", "+lease-2"]
    rows = sorted(ledger.views.jobs("fast"), key=lambda r: r["requested_at"])
    limits = _Released()
    done = reconcile(ledger, limits)  # type: ignore[arg-type]
    if point == "before-commit":
        # no row, nothing reserved: the lease only makes Prefect stricter until it lapses
        assert [r["state"] for r in rows] == ["settled"]
        assert done == [] and limits.released == []
    else:
        # admitted with its lease on record: reconcile settles it at zero and gives it back
        assert [r["state"] for r in rows] == ["settled", "admitted"]
        assert rows[1]["lease_id"] == "lease-2" and rows[1]["reserved_micro"] > 0
        assert [d.action for d in done] == ["settled"] and done[0].actual_micro == 0
        assert limits.released == ["lease-2"]
    assert ledger.views.status("fast")[0]["reserved_micro"] == 0
    assert reconcile(ledger, limits) == []  # type: ignore[arg-type]
