"""The simulator runs the gate's own decision: it agrees with the live gate, and guaranteed mode
never overshoots a period budget whatever the runtimes."""

from __future__ import annotations

import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Hold, overrun_factors
from prefect_gpu_budget.admission.rules.quota import Placed, Pool, Shape, TeamQuota
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.sweeps.simulator import OverrunWindows, SimJob, simulate
from prefect_gpu_budget.sweeps.traces import synthetic_trace

RATE = 3_600_000  # local:box, $3.60/h
BUDGETS = [
    BudgetRule("sim", hourly_cap_cents=720, period_budget_micro=10**9, period="day"),
    BudgetRule("sim/a", hourly_cap_cents=360, period_budget_micro=10**9, period="week"),
    BudgetRule("sim/b"),  # team b exists (no limits of its own), as the live gate requires
]
# (scope, arrival offset s, runtime s, priority): two scopes, a dozen jobs, known runtimes,
# spaced so that no two arrivals or ends fall within 0.14 s (live threads add jitter)
SCALE = 3.0
SCENARIO = [
    (scope, SCALE * at, SCALE * run, priority)
    for scope, at, run, priority in [
        ("sim/a", 0.0, 1.2, 0),
        ("sim/b", 0.1, 0.8, 0),
        ("sim/a", 0.3, 0.6, 0),
        ("sim/b", 0.5, 0.9, 0),
        ("sim/b", 0.7, 0.55, 100),
        ("sim/a", 1.0, 0.7, 0),
        ("sim/b", 1.15, 0.6, 0),
        ("sim/a", 1.3, 0.65, 100),
        ("sim/b", 1.6, 0.8, 0),
        ("sim/b", 1.75, 0.45, 0),
        ("sim/a", 2.05, 0.6, 0),
        ("sim/b", 2.2, 0.5, 0),
    ]
]


def test_simulator_and_live_gate_agree(tmp_path, prices):
    jobs = [
        GpuJob(instance_type="local:box", max_runtime="1m", priority=priority, name=str(i))
        for i, (_, _, _, priority) in enumerate(SCENARIO)
    ]
    sim = simulate(
        [
            SimJob(str(i), scope, at, RATE, run, run, jobs[i].reserve_runtime_s, priority)
            for i, (scope, at, run, priority) in enumerate(SCENARIO)
        ],
        BUDGETS,
        "guaranteed",
    )

    def live(attempt: int) -> tuple[list[str], Ledger]:
        """The scenario on the live gate, in threads; the admission order and the ledger."""
        ledger = Ledger(f"sqlite:///{tmp_path / f'ledger-{attempt}.db'}")
        for rule in BUDGETS:
            ledger.config.set_budget(rule)
        gate = Gate(ledger, catalog=Catalog.load(prices), poll_s=0.01)
        order: list[str] = []
        lock = threading.Lock()
        t0 = time.monotonic() + 0.5

        def run(i: int) -> None:
            scope, at, runtime, _ = SCENARIO[i]
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            admission = gate.admit(jobs[i], scope)
            with lock:
                order.append(str(i))
            gate.holding.started(admission, time.time())
            time.sleep(runtime)
            gate.holding.settle(admission, ended_at=time.time(), outcome="completed")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(SCENARIO))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return order, ledger

    # A stalled thread on a busy machine can move one event past its neighbour (0.42 s apart);
    # a wrong decision gives the wrong order every time, so the live run gets three tries.
    for attempt in range(3):
        order, ledger = live(attempt)
        if order == sim.order:
            break
    times = sorted([r.job.arrival for r in sim.records] + [r.ended_at for r in sim.records])
    assert min(b - a for a, b in zip(times, times[1:], strict=False)) > 0.14  # the premise
    assert order == sim.order
    rows = ledger.views.jobs("sim")
    live_total = sum(r["actual_micro"] for r in rows)
    sim_total = sum(r.actual_micro for r in sim.records)
    # Live sleeps overrun their runtimes, by a few ms on a quiet machine and by a second or more
    # on a busy one: the live gate bills what ran, so the two totals differ by that overrun's
    # cost at the rate, and by no more than 5% beyond it.
    overrun_s = sum(r["ended_at"] - r["started_at"] for r in rows) - sum(s[2] for s in SCENARIO)
    assert abs(live_total - sim_total - RATE * overrun_s / 3600) <= 0.05 * sim_total


def test_jobs_in_a_capacity_pool_wait_for_their_teams_quota():
    """A team's quota of two machines, one taken by a job already running for 30 s more: four
    one-machine jobs of 60 s run as the gate places them, never more than two at once."""
    start = 1_798_761_600.0
    pool = Pool("o", "lab", 4, (1, 8, 64), ("local:box",))
    quota = TeamQuota("lab", "o/a", (2, 16, 128), borrow_pct=0)
    machine = Shape("lab", "o/a", (1, 8, 64), 1)
    running = Hold("o/a/x", 360, 360_000, start - 60, start + 30, RATE, start + 30)
    where = Placed("elsewhere", machine, (3,), 0, start - 60)
    jobs = [SimJob(f"j{i}", "o/a/s", start + i, RATE, 60, 60, 120, shape=machine) for i in range(4)]
    result = simulate(
        jobs,
        [BudgetRule("o"), BudgetRule("o/a")],
        holds=[running],
        placed=[where],
        pools=[pool],
        quotas=[quota],
    )
    assert [r.admitted_at - start for r in result.records] == [0, 30, 60, 90]
    free = simulate(jobs, [BudgetRule("o"), BudgetRule("o/a")])  # no pool: nothing to wait for
    assert [r.admitted_at - start for r in free.records] == [0, 1, 2, 3]


def test_a_job_starting_holds_its_cap_unbilled_and_runs_its_max_runtime_from_its_start():
    """A launch of 60 s before each job: one at a time under the cap, the second job waits for
    the first's start and run; each is billed its run, and a job stopped at max_runtime runs
    it from its start, not from its admission."""
    start = 1_798_761_600.0
    jobs = [SimJob(name, "o", start, 3_600_000, 600, 600, 900, start_s=60.0) for name in ("a", "b")]
    result = simulate(jobs, [BudgetRule("o", hourly_cap_cents=360)], "guaranteed")
    first, second = sorted(result.records, key=lambda r: r.admitted_at)
    assert (first.admitted_at, first.started_at, first.ended_at) == (start, start + 60, start + 660)
    assert second.admitted_at == start + 660 and second.ended_at == start + 1320
    assert first.actual_micro == second.actual_micro == 600_000  # 600 s of $3.60/h: not the start
    assert first.finished and second.finished
    overrun = SimJob("c", "o", start, 3_600_000, 600, 1200, 900, start_s=60.0)
    [stopped] = simulate([overrun], [BudgetRule("o", hourly_cap_cents=360)], "guaranteed").records
    assert stopped.ended_at == start + 60 + 900 and stopped.actual_micro == 900_000
    assert not stopped.finished


@settings(max_examples=40, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.floats(0, 2 * 86400),  # arrival
            st.sampled_from([1_006_000, 5_672_000, 21_958_000, 54_894_000]),  # rate
            st.floats(60, 8 * 3600),  # expected runtime
            st.floats(0.05, 6.0),  # true / expected
            st.floats(1.0, 3.0),  # max runtime / expected
            st.sampled_from(["o/a/s1", "o/a/s2", "o/b/s1"]),
        ),
        min_size=1,
        max_size=40,
    ),
    day_budget=st.integers(5, 2_000),
    week_budget=st.integers(20, 5_000),
    cap=st.integers(100, 20_000),
)
def test_guaranteed_mode_never_overshoots(jobs, day_budget, week_budget, cap):
    start = 1_798_761_600.0
    sim_jobs = [
        SimJob(f"j{i}", scope, start + at, rate, exp, exp * ratio, exp * factor)
        for i, (at, rate, exp, ratio, factor, scope) in enumerate(jobs)
    ]
    budgets = [
        BudgetRule(
            "o", hourly_cap_cents=cap, period_budget_micro=week_budget * 10**6, period="week"
        ),
        BudgetRule(
            "o/a", period_budget_micro=day_budget * 10**6, period="day", timezone="Asia/Kolkata"
        ),
        BudgetRule("o/b/s1", period_budget_micro=day_budget * 10**6, period="day"),
    ]
    result = simulate(sim_jobs, budgets, "guaranteed", until=start + 9 * 86400)
    assert result.overshoot_pct() == 0.0


def test_forecast_frees_jobs_already_running_when_they_end():
    start = 1_798_761_600.0
    running = Hold("o", 100, 1_000_000, start - 600, start + 3000, 1_000_000, start + 3000)
    trial = SimJob("t", "o", start, 1_000_000, 600, 600, 600)
    result = simulate([trial], [BudgetRule("o", hourly_cap_cents=100)], holds=[running])
    [record] = result.records
    assert record.admitted_at == start + 3000


@settings(max_examples=40, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.floats(0, 2 * 86400),  # arrival
            st.floats(60, 8 * 3600),  # expected runtime
            st.floats(0.05, 6.0),  # true / expected
            st.floats(1.0, 3.0),  # max runtime / expected
            st.sampled_from(["o/a/s1", "o/a/s2", "o/b/s1"]),
        ),
        min_size=1,
        max_size=40,
    ),
    day_budget=st.integers(5, 500),
)
def test_estimate_mode_lets_no_one_job_overshoot(jobs, day_budget):
    """One job at a time (the hourly cap fits one): estimate mode admits a job only where its
    worst case fits, so however far it overruns its estimate, no budget is overshot."""
    start = 1_798_761_600.0
    rate = 21_958_000
    sim_jobs = [
        SimJob(f"j{i}", scope, start + at, rate, exp, exp * ratio, exp * factor)
        for i, (at, exp, ratio, factor, scope) in enumerate(jobs)
    ]
    budgets = [
        BudgetRule(
            "o", hourly_cap_cents=2196, period_budget_micro=day_budget * 10**6, period="day"
        ),
        BudgetRule("o/a", period_budget_micro=day_budget * 3 * 10**6, period="week"),
    ]
    result = simulate(sim_jobs, budgets, "estimate-metered", until=start + 9 * 86400)
    assert result.overshoot_pct() == 0.0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["o/a/s1", "o/a/s2", "o/b/s1", "p/c"]), st.floats(0.1, 4.0)),
        max_size=400,
    )
)
def test_simulator_learns_what_the_ledger_would_supply(history):
    assert OverrunWindows(history).factors == overrun_factors(history)


def test_a_scope_whose_jobs_overran_reserves_more_in_estimate_mode():
    start = 1_798_761_600.0
    rule = BudgetRule("o", hourly_cap_cents=200, period_budget_micro=1_800_000, period="day")
    # $1/h each, 30 min expected ($0.50), 1 h at worst ($1): the second fits beside the first's
    # estimate, but not beside twice it
    jobs = [SimJob(f"j{i}", "o/a", start + i, 1_000_000, 1800, 1800, 3600) for i in range(2)]
    fresh = simulate(jobs, [rule], "estimate-metered")
    assert [r.admitted_at for r in fresh.records] == [start, start + 1]
    overran = simulate(jobs, [rule], "estimate-metered", history=[("o/a", 2.0)] * 20)
    assert [r.admitted_at for r in overran.records] == [start, start + 1800]


def test_synthetic_traces_have_the_shapes_they_claim():
    """The benchmark's traces: `heavy-tail` is heavy-tailed in job size with every job fitting
    its max_runtime; `overrun-tail` is heavy-tailed in estimate error, about 10% of its jobs
    needing more than their max_runtime."""

    def top_share(trace: list[SimJob]) -> float:
        sizes = sorted((j.expected_s for j in trace), reverse=True)
        return sum(sizes[: len(sizes) // 100]) / sum(sizes)

    def over_max(trace: list[SimJob]) -> float:
        return sum(j.true_s > j.max_runtime_s for j in trace) / len(trace)

    lognormal, heavy, overrun = (
        synthetic_trace(5000, seed=3, kind=kind)
        for kind in ("lognormal", "heavy-tail", "overrun-tail")
    )
    assert top_share(lognormal) < 0.05 < 0.10 < top_share(heavy)
    assert max(j.expected_s for j in heavy) <= 86400 and min(j.expected_s for j in heavy) >= 900
    assert over_max(lognormal) == over_max(heavy) == 0.0
    assert 0.08 < over_max(overrun) < 0.12
