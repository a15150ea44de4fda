"""The gate against real processes, a real Prefect server and both databases.

Promise 1 (no over-admission), 3 (nothing lost, settle once) and 5 (liveness) are checked from
the ledger's own timestamps after racing many processes against one nested budget.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.audit import promise1_violations
from prefect_gpu_budget.admission.errors import AdmissionGone
from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import scope_path
from tests.support.jobs import new_job
from tests.support.limits import SlowLimits
from tests.support.prefect_server import wait_for

RACE_SCOPES = ["race/a/s1", "race/a/s2", "race/b/s1", "race/b/s2"]
RACE_BUDGETS = [
    BudgetRule("race", hourly_cap_cents=1800, period_budget_micro=25_000, period="month"),
    BudgetRule("race/a", hourly_cap_cents=1080, period="week"),
    BudgetRule("race/b", hourly_cap_cents=1080, period_budget_micro=14_000, period="week"),
    BudgetRule("race/a/s1", hourly_cap_cents=720, period_budget_micro=12_000, period="day"),
    BudgetRule("race/a/s2", hourly_cap_cents=720),
    BudgetRule("race/b/s1", hourly_cap_cents=720),
    BudgetRule("race/b/s2", hourly_cap_cents=720),
]


def _budget_full(
    rows: list[dict], gave_up: dict, rules: list[BudgetRule], reservation: int
) -> bool:
    """Whether, a second before `gave_up` timed out, some period budget on its path had less
    than one reservation left: settled spend plus what admitted, unsettled jobs held, read from
    the ledger's own timestamps (a second's slack for a settlement the waiter had not yet seen).
    """
    at = (gave_up["settled_at"] or gave_up["ended_at"]) - 1.0
    budgets = {r.scope: r.period_budget_micro for r in rules if r.period_budget_micro}
    for scope in scope_path(gave_up["scope"]):
        if scope not in budgets:
            continue
        inside = [r for r in rows if r["scope"] == scope or r["scope"].startswith(scope + "/")]
        committed = sum(
            (r["actual_micro"] or 0) if r["settled_at"] <= at else r["reserved_micro"]
            for r in inside
            if r["admitted_at"] is not None and r["admitted_at"] <= at
        )
        if committed + reservation > budgets[scope]:
            return True
    return False


def _race_worker(
    ledger_url: str, api_url: str, prices: str, scope: str, jobs: int, seed: int, out
) -> None:
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.limits import RateLimits

    ledger = Ledger(ledger_url)
    client = get_client(sync_client=True)
    client.__enter__()
    gate = Gate(ledger, RateLimits(client), catalog=Catalog.load(Path(prices)))
    rng = random.Random(seed)
    results = []
    for _ in range(jobs):
        job = GpuJob(
            instance_type="local:race",
            max_runtime="5s",
            kill_grace="1s",
            priority=rng.choice([0, 0, 1]),
            max_wait="12s",
        )
        try:
            admission = gate.admit(job, scope)
        except AdmissionRefused as refused:
            results.append({"refused": refused.state_name})
            continue
        gate.holding.started(admission, time.time())
        time.sleep(rng.uniform(0.05, 0.25))
        gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
        again = ledger.settlements.settle(
            admission.job_id, ended_at=time.time() + 100, outcome="completed"
        )
        results.append({"settled": admission.job_id, "second_settle": again})
    out.put(results)


@pytest.mark.timeout(300)
def test_race_many_processes_never_over_admit(ledger_url, prefect_api, prices):
    ledger = Ledger(ledger_url)
    for rule in RACE_BUDGETS:
        ledger.config.set_budget(rule)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_race_worker,
            args=(ledger_url, prefect_api, str(prices), RACE_SCOPES[i % 4], 4, i, out),
        )
        for i in range(16)
    ]
    for p in procs:
        p.start()
    results = [item for _ in procs for item in out.get(timeout=240)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    rows = ledger.views.jobs("race")
    assert len(rows) == 64
    admitted = [r for r in rows if r["admitted_at"] is not None]
    # every admitted job settled exactly once; a second settle changed nothing
    assert all(r["state"] == "settled" and r["settled_at"] for r in admitted)
    assert sum(1 for r in results if "settled" in r) == len(admitted)
    assert not any(r.get("second_settle") for r in results)
    assert all(r["ended_at"] < r["settled_at"] + 1 for r in admitted)
    assert promise1_violations(rows, RACE_BUDGETS) == []
    # nothing over-charged: period spend in the ledger equals the sum of the jobs' costs
    p_start = {s["scope"]: s for s in ledger.views.status()}["race"]["period_start"]
    assert ledger.views.period_settled("race", p_start) == sum(r["actual_micro"] for r in admitted)
    # no starvation: jobs only time out once the period budget cannot take another job
    timed_out = [r for r in rows if r["state"] == "timed_out"]
    # (its reason may name a budget or, as legitimately, the job it queued behind)
    for r in timed_out:  # when it gave up, a period budget on its path had no room for it
        assert _budget_full(rows, r, RACE_BUDGETS, reservation=6_000), r
    # every scope raced (how many got in within their 12 s max wait is the machine's speed)
    assert {r["scope"] for r in admitted} == set(RACE_SCOPES)
    # the Prefect limits hold no slot once everything settled
    from prefect_gpu_budget.admission.limits import RateLimits

    limits = RateLimits()
    assert all(limits.active_slots(rule.scope) == 0 for rule in RACE_BUDGETS)
    limits.close()


def test_a_blocked_job_resumes_when_its_blocker_settles(ledger, prefect_api, prices):
    """The settle wakes the waiter: its gate's periodic recheck is an hour away, so only the
    ledger's change can admit it within the test's deadline."""
    from prefect_gpu_budget.admission.limits import RateLimits

    ledger.config.set_budget(BudgetRule("resume", hourly_cap_cents=400))
    ledger.config.set_budget(BudgetRule("resume/t"))  # the team exists: a job may spend there
    limits = RateLimits()
    gate = Gate(ledger, limits, catalog=Catalog.load(prices), recheck_s=3600)
    job = GpuJob(instance_type="local:box", max_runtime="1m")
    first = gate.admit(job, "resume/t/s")
    gate.holding.started(first, time.time())
    got: dict[str, object] = {}

    def second() -> None:
        got["admission"] = gate.admit(job, "resume/t/s")

    waiter = threading.Thread(target=second)
    waiter.start()
    [queued] = wait_for(
        lambda: ledger.views.jobs("resume", states=("queued",)), 120, "the second job to queue"
    )
    assert "blocked by hourly cap of resume" in queued["reason"], queued["reason"]
    assert "admission" not in got, "admitted over the hourly cap"
    gate.holding.settle(first, ended_at=time.time(), outcome="completed")
    waiter.join(timeout=120)
    assert "admission" in got, "still waiting after its blocker settled"
    gate.holding.settle(got["admission"], ended_at=time.time(), outcome="completed")
    assert limits.active_slots("resume") == 0
    limits.close()


def test_priority_then_arrival_order(ledger, prices):
    ledger.config.set_budget(BudgetRule("prio", hourly_cap_cents=360))
    gate = Gate(ledger, catalog=Catalog.load(prices), recheck_s=0.2)
    running = gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "prio/t")
    order: list[str] = []

    def wait(name: str, priority: int) -> None:
        a = gate.admit(
            GpuJob(instance_type="local:box", max_runtime="1m", priority=priority), "prio/t"
        )
        order.append(name)
        time.sleep(0.3)
        gate.holding.settle(a, ended_at=time.time(), outcome="completed")

    threads = []
    for name, priority in [("low-1", -100), ("normal-1", 0), ("high-1", 100), ("normal-2", 0)]:
        threads.append(threading.Thread(target=wait, args=(name, priority)))
        threads[-1].start()
        queued = len(threads)  # each waits in line before the next arrives
        wait_for(
            lambda n=queued: len(ledger.views.jobs("prio", states=("queued",))) == n, 120, name
        )
    gate.holding.settle(running, ended_at=time.time(), outcome="completed")
    for t in threads:
        t.join(timeout=120)
    assert order == ["high-1", "normal-1", "normal-2", "low-1"]


def test_reject_and_timeout_carry_the_reason(ledger, prices):
    ledger.config.set_budget(BudgetRule("rt", hourly_cap_cents=360, on_limit="reject"))
    ledger.config.set_budget(BudgetRule("rt/wait", hourly_cap_cents=360, max_wait_s=1.0))
    gate = Gate(ledger, catalog=Catalog.load(prices))
    held = gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "rt")
    with pytest.raises(AdmissionRefused) as refused:
        gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "rt")
    assert refused.value.state_name == "OverBudget"
    assert "hourly cap of rt" in refused.value.reason
    started = time.time()
    with pytest.raises(AdmissionRefused) as timed_out:
        gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "rt/wait")
    assert timed_out.value.state_name == "AdmissionTimeout"
    assert "max wait 1s ran out" in timed_out.value.reason
    assert time.time() - started > 0.9  # it waited out its max wait
    gate.holding.settle(held, ended_at=time.time(), outcome="completed")
    states = sorted(r["state"] for r in ledger.views.jobs("rt"))
    assert states == ["rejected", "settled", "timed_out"]


CRASHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import Catalog
    gate = Gate(Ledger(sys.argv[1]), catalog=Catalog.load(Path(sys.argv[2])), heartbeat_s=0.2)
    a = gate.admit(GpuJob(instance_type="local:box", max_runtime="10m"), "crash/t/s")
    if sys.argv[3] == "running":
        gate.holding.started(a, time.time())
    print("admitted", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("point", ["admitted", "running"])
def test_sigkill_between_reservation_and_settlement(ledger, ledger_url, prices, point):
    ledger.config.set_budget(
        BudgetRule("crash", hourly_cap_cents=10_000, period_budget_micro=50_000_000)
    )
    ledger.config.set_budget(BudgetRule("crash/t"))
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, ledger_url, str(prices), point],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "admitted"
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    [row] = ledger.views.jobs("crash")
    assert row["state"] == ("admitted" if point == "admitted" else "running")
    assert row["reserved_micro"] == 610_000  # $3.60/h for 10m plus 10s of kill grace
    status = ledger.views.status("crash")[0]
    assert status["reserved_micro"] == row["reserved_micro"]  # the worst case stays held

    done = reconcile(ledger)
    assert [d.action for d in done] == ["settled"]
    settled = ledger.views.job(row["id"])
    assert settled["state"] == "settled"
    if point == "admitted":
        assert settled["actual_micro"] == 0
    else:  # charged up to the last heartbeat plus one interval: at most the reservation
        assert 0 < settled["actual_micro"] <= row["reserved_micro"]
    assert reconcile(ledger) == []  # nothing left; settling again charges nothing
    assert ledger.settlements.settle(row["id"], ended_at=time.time(), outcome="again") is None
    status = ledger.views.status("crash")[0]
    assert status["reserved_micro"] == 0
    assert status["settled_micro"] == settled["actual_micro"]


def test_a_slow_request_for_slots_keeps_stamping_the_row(ledger, prices, monkeypatch):
    """Reconcile counts a lease a crashed admission may have taken unrecorded from the row's
    last stamp: while the request is outstanding the row is stamped, so a grant that comes late
    is still inside that window."""
    from prefect_gpu_budget.admission import leases
    from prefect_gpu_budget.admission.reconcile import awaiting_lease_expiry
    from prefect_gpu_budget.admission.rules.timing import UNRECORDED_LEASE_S

    monkeypatch.setattr(leases, "LIVENESS_S", 0.05)
    ledger.config.set_budget(BudgetRule("slow", hourly_cap_cents=720))
    limits = SlowLimits(delay=1.5)  # stamps every 0.05 s: one late in the wait, even if starved
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    admission = gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "slow/t")
    (row,) = ledger.views.jobs("slow")
    assert row["lease_id"] == "lease-1"
    assert row["heartbeat_at"] - row["admitted_at"] >= 0.4

    row = {**row, "lease_id": None}  # as if it had died before recording the lease
    late = row["admitted_at"] + UNRECORDED_LEASE_S + 0.3  # past the window of admission alone
    assert awaiting_lease_expiry(ledger, row, late)
    assert not awaiting_lease_expiry(ledger, row, row["heartbeat_at"] + UNRECORDED_LEASE_S + 1)
    gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
    assert limits.released == ["lease-1"]


class _Interrupted(BaseException):
    """What a signal handler raises in the main thread (as Ctrl-C or a cancelled run does)."""


def _interrupt(signum, frame):
    raise _Interrupted


def test_an_interrupt_while_slots_are_being_taken_leaves_no_lease(ledger, prices):
    """The main thread waits for the thread taking the slots; a signal that interrupts that wait
    must not let it go on as if that thread had ended (a plain `Thread.join` does, on CPython
    3.11), or the lease taken a moment later would be recorded on a settled row and never
    released."""

    ledger.config.set_budget(BudgetRule("intr", hourly_cap_cents=720))
    limits = SlowLimits(delay=300)  # answers when the test says so
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))

    def interrupt_while_asked() -> None:
        if limits.asked.wait(120):  # the request for slots is outstanding
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        threading.Thread(target=interrupt_while_asked, daemon=True).start()
        with pytest.raises(_Interrupted):
            gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "intr/t")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    limits.go.set()  # the slots come now, after the interrupt
    wait_for(lambda: limits.released, 60, "the late lease to be released")
    assert limits.taken == ["lease-1"]
    assert limits.released == ["lease-1"]
    (row,) = ledger.views.jobs("intr")
    assert (row["state"], row["outcome"]) == ("settled", "cancelled")


def test_a_lease_is_recorded_only_on_an_active_job(ledger):
    ledger.config.set_budget(BudgetRule("rec", hourly_cap_cents=720))
    job_id, decision = ledger.queue.request(new_job("rec/t"))
    assert decision.verdict == "admit"
    assert ledger.settlements.record_lease(job_id, "lease-a")
    ledger.settlements.settle(job_id, ended_at=time.time(), outcome="cancelled")
    assert not ledger.settlements.record_lease(job_id, "lease-b")
    assert ledger.views.job(job_id)["lease_id"] == "lease-a"


def test_slots_taken_for_a_job_settled_meanwhile_go_back(ledger, prices):
    """A cancellation can settle the job while its slots are still being taken (it may land
    before the caller even waits for the thread taking them): that thread then finds the job
    no longer active, records nothing and releases the lease itself."""
    ledger.config.set_budget(BudgetRule("gone", hourly_cap_cents=720))
    limits = SlowLimits(delay=300)  # answers when the test says so
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))

    def settle_meanwhile() -> None:
        if limits.asked.wait(120):  # the request for slots is outstanding
            (row,) = ledger.views.jobs("gone")
            ledger.settlements.settle(row["id"], ended_at=time.time(), outcome="cancelled")
        limits.go.set()  # the slots come after the settlement

    threading.Thread(target=settle_meanwhile, daemon=True).start()
    with pytest.raises(AdmissionGone):
        gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "gone/t")
    wait_for(lambda: limits.released, 60, "the lease to be released")
    assert limits.taken == limits.released == ["lease-1"]
    (row,) = ledger.views.jobs("gone")
    assert (row["state"], row["lease_id"]) == ("settled", None)


def test_an_interrupt_as_the_admission_thread_starts_leaves_nothing(ledger, prices, monkeypatch):
    """A signal can land just after the admission thread has started, before the caller waits
    for it: that thread hears of it and gives the job back, wherever it had got to."""
    import _thread

    start = _thread.start_new_thread
    calls: list[int] = []

    def start_then_interrupted(function, args):
        start(function, args)
        calls.append(1)
        if len(calls) == 1:  # the admission thread; not the settlement's after it
            raise _Interrupted

    monkeypatch.setattr(_thread, "start_new_thread", start_then_interrupted)
    ledger.config.set_budget(BudgetRule("start", hourly_cap_cents=720))
    for delay in (0.0, 0.5):  # a quick and a slow Prefect API
        calls.clear()
        limits = SlowLimits(delay=delay)
        gate = Gate(ledger, limits, catalog=Catalog.load(prices))
        with pytest.raises(_Interrupted):
            gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "start/t")
        assert limits.taken == limits.released
    # the thread may not have recorded the request yet when it heard: then there is no row
    assert {r["state"] for r in ledger.views.jobs("start")} <= {"settled", "cancelled"}
    assert all(s["reserved_micro"] == 0 for s in ledger.views.status("start"))


def test_the_caller_of_admit_runs_no_ledger_or_prefect_code(ledger, prices):
    """A cancellation can land at any bytecode of the thread that calls `admit`; inside the
    ledger's pool or the HTTP client it could leave a lock held that every other thread then
    waits on for good. So that thread only waits: every connection checkout and every Prefect
    call of an admission that waits, is admitted, and of one cancelled while waiting happens
    in another thread."""
    import sqlalchemy as sa

    caller = threading.get_ident()
    seen: list[tuple[str, int]] = []

    class _Watched(SlowLimits):
        def acquire(self, scopes, slots):
            seen.append(("prefect", threading.get_ident()))
            return super().acquire(scopes, slots)

        def release(self, lease_id):
            seen.append(("prefect", threading.get_ident()))
            super().release(lease_id)

    ledger.config.set_budget(BudgetRule("who", hourly_cap_cents=360))  # one job at a time
    sa.event.listen(
        ledger.db.engine, "checkout", lambda *a: seen.append(("ledger", threading.get_ident()))
    )
    limits = _Watched(delay=0.0)
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    job = GpuJob(instance_type="local:box", max_runtime="1m")
    first = gate.admit(job, "who/t")
    threading.Timer(
        0.3, gate.holding.settle, (first,), {"ended_at": time.time(), "outcome": "done"}
    ).start()
    second = gate.admit(job, "who/t")  # waits for the first, then is admitted
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:

        def interrupt_once_it_waits() -> None:  # an interrupt before its request records none
            wait_for(lambda: ledger.views.jobs("who", states=("queued",)), 60, "the job to wait")
            os.kill(os.getpid(), signal.SIGUSR1)

        threading.Thread(target=interrupt_once_it_waits, daemon=True).start()
        with pytest.raises(_Interrupted):
            gate.admit(job, "who/t")  # waits behind the second, is cancelled
    finally:
        signal.signal(signal.SIGUSR1, previous)
    gate.holding.started(second, time.time())
    gate.holding.settle(second, ended_at=time.time(), outcome="done")
    assert {kind for kind, _ in seen} == {"ledger", "prefect"}
    assert [kind for kind, ident in seen if ident == caller] == []
    assert sorted(r["state"] for r in ledger.views.jobs("who")) == [
        "cancelled",
        "settled",
        "settled",
    ]


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_as_the_job_is_admitted_gives_it_back(ledger, prices, monkeypatch, when):
    """The cancellation and the admission race: whichever is claimed first, the admission goes
    back (settled by the admission thread, or by the caller once it has heard)."""
    from prefect_gpu_budget.admission import gate as gate_module

    claim = gate_module._Handoff.claim

    def claim_with_interrupt(self, who):
        if who == "admitted" and when == "before":
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)  # the caller's wait hears it and claims first
        won = claim(self, who)
        if who == "admitted" and when == "after":
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
        return won

    monkeypatch.setattr(gate_module._Handoff, "claim", claim_with_interrupt)
    ledger.config.set_budget(BudgetRule("race-in", hourly_cap_cents=720))
    limits = SlowLimits(delay=0.0)
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        with pytest.raises(_Interrupted):
            gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "race-in/t")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    (row,) = ledger.views.jobs("race-in")
    assert (row["state"], row["outcome"]) == ("settled", "cancelled")
    assert limits.taken == limits.released == ["lease-1"]
    assert ledger.views.status("race-in")[0]["reserved_micro"] == 0
