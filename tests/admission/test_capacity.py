"""Quota, capacity, rate cap and budget in one decision, through the ledger and the gate, on
SQLite and PostgreSQL: gang admission with max wait, no starvation, no over-commit in a race."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import Ledger, NewJob
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, add, fits_in, proportional
from prefect_gpu_budget.job import GpuJob
from tests.support.jobs import new_job
from tests.support.prefect_server import wait_for

NODE = (8, 192, 2048)


def _pool(nodes: int, **kw) -> Pool:
    return Pool("acme", "lab-a", nodes, NODE, ("local:h100x8",), "H100", **kw)


def _job(scope: str, nodes: int = 1, gpus: int = 8, priority: int = 0, **kw) -> NewJob:
    return new_job(
        scope,
        name=f"{nodes}x{gpus}",
        instance_type="local:h100x8",
        nodes=nodes,
        rate_micro_per_hour=1_000_000,
        rate_cents=100,
        priority=priority,
        node_gpus=gpus,
        **kw,
    )


def test_a_gang_job_waits_whole_and_times_out_as_dws_does(ledger):
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9, max_wait_s=86400))
    ledger.config.set_pool(_pool(3))
    first, admitted = ledger.queue.request(_job("acme/a/s", nodes=2))
    assert admitted.verdict == "admit" and admitted.placement in ((0, 1), (0, 2), (1, 2))
    second, waiting = ledger.queue.request(_job("acme/a/s", nodes=2, max_wait_s=0.5))
    assert waiting.verdict == "wait"
    assert waiting.reason == "waiting for 2 x 8 H100 in pool lab-a: 1 node free"
    assert ledger.views.job(second)["placement"] is None  # nothing held in part while it waits
    time.sleep(0.6)
    timed_out = ledger.queue.try_admit(second, "acme/a/s")
    assert timed_out.verdict == "timeout" and "max wait" in timed_out.reason
    ledger.settlements.settle(first, ended_at=time.time(), outcome="completed", scope="acme/a/s")


def test_a_big_job_is_not_starved_by_small_ones_unless_backfill_allows(ledger):
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_pool(_pool(2))
    small, _ = ledger.queue.request(_job("acme/a/s", nodes=1))
    big, waits = ledger.queue.request(_job("acme/a/s", nodes=2))
    assert waits.verdict == "wait"
    later, behind = ledger.queue.request(_job("acme/b/s", nodes=1))  # fits now, but queues behind
    assert behind.verdict == "wait" and f"waiting behind job {big[:8]}" in behind.reason
    ledger.settlements.settle(small, ended_at=time.time(), outcome="completed", scope="acme/a/s")
    assert ledger.queue.try_admit(big, "acme/a/s").verdict == "admit"
    assert ledger.queue.try_admit(later, "acme/b/s").verdict == "wait"
    ledger.settlements.settle(big, ended_at=time.time(), outcome="completed", scope="acme/a/s")
    assert ledger.queue.try_admit(later, "acme/b/s").verdict == "admit"
    ledger.settlements.settle(later, ended_at=time.time(), outcome="completed", scope="acme/b/s")

    ledger.config.set_pool(_pool(2, backfill=True))
    small, _ = ledger.queue.request(_job("acme/a/s", nodes=1))
    big, _ = ledger.queue.request(_job("acme/a/s", nodes=2))
    assert ledger.queue.request(_job("acme/b/s", nodes=1))[1].verdict == "admit"  # backfilled


def test_quota_capacity_and_budget_are_one_decision(ledger):
    pool = _pool(2)
    ledger.config.set_pool(
        pool, [TeamQuota("lab-a", "acme/a", proportional(pool, 8), borrow_pct=0)]
    )
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=20_000))  # one 1-minute job
    _, never = ledger.queue.request(_job("acme/z/s"))
    assert never.verdict == "reject" and "team acme/z has no quota in pool lab-a" in never.reason
    first, ok = ledger.queue.request(_job("acme/a/s", gpus=4))
    assert ok.verdict == "admit"
    _, both = ledger.queue.request(_job("acme/a/s", gpus=8))
    assert both.verdict == "wait"
    assert "budget of acme" in both.reason and "quota" in both.reason  # every reason at once
    assert not both.preempt


def _racer(url: str, index: int, count: int) -> None:
    ledger = Ledger(url)
    gate = Gate(ledger, poll_s=0.02)
    team = "acme/a" if index % 2 else "acme/b"
    for i in range(count):
        job = GpuJob(
            instance_type="local:h100x8",
            max_runtime="60s",
            nodes=1 + (index + i) % 2,
            kill_grace="1s",
        )
        admission = gate.admit(job, f"{team}/r{index}")
        gate.holding.started(admission, time.time(), f"race:{index}:{i}")
        time.sleep(0.05)
        gate.holding.settle(admission, ended_at=time.time(), outcome="completed")


@pytest.mark.timeout(600)
def test_racing_admitters_never_over_commit_quota_or_capacity(
    ledger, ledger_url, tmp_path, monkeypatch
):
    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.pricing.catalog import set_local_price

    prices = set_local_price("h100x8", "1", gpus=8, path=tmp_path / "prices.csv")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))  # the racers inherit it
    default_catalog.cache_clear()
    pool = _pool(3)
    quotas = [
        TeamQuota("lab-a", "acme/a", proportional(pool, 8), borrow_pct=100),
        TeamQuota("lab-a", "acme/b", proportional(pool, 16), borrow_pct=50),
    ]
    ledger.config.set_pool(pool, quotas)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_racer, args=(ledger_url, i, 4)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=400)
    assert all(p.exitcode == 0 for p in procs)
    rows = ledger.views.jobs()
    assert len(rows) == 32 and all(r["state"] == "settled" for r in rows)
    # every instant at which something was admitted: nothing over any node, quota or ceiling
    for moment in sorted({r["admitted_at"] for r in rows}):
        live = [r for r in rows if r["admitted_at"] <= moment < r["settled_at"]]
        per_node = [(0, 0, 0)] * pool.nodes
        team_use = {q.team: (0, 0, 0) for q in quotas}
        for r in live:
            shape = (r["node_gpus"], r["node_vcpu"], r["node_memory_gib"])
            for index in map(int, r["placement"].split(",")):
                per_node[index] = add(per_node[index], shape)
            team_use[r["team"]] = add(team_use[r["team"]], tuple(x * r["nodes"] for x in shape))
        assert all(fits_in(used, NODE) for used in per_node), (moment, per_node)
        for q in quotas:
            assert fits_in(team_use[q.team], q.ceiling), (moment, q.team, team_use)


def test_a_partial_gpu_job_takes_its_share_of_vcpu_and_memory(ledger):
    """HyperPod: 2 of a node's 8 GPUs bring 2/8 of its vCPU and memory, unless given."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_pool(_pool(1))
    job_id, decision = ledger.queue.request(_job("acme/a/s", gpus=2))
    assert decision.verdict == "admit"
    row = ledger.views.job(job_id)
    assert (row["node_gpus"], row["node_vcpu"], row["node_memory_gib"]) == (2, 48, 512)
    explicit, _ = ledger.queue.request(_job("acme/a/s", gpus=2, node_vcpu=8, node_memory_gib=64))
    assert (
        ledger.views.job(explicit)["node_vcpu"],
        ledger.views.job(explicit)["node_memory_gib"],
    ) == (8, 64)
    [pool] = ledger.views.capacity_status("acme")
    assert pool["used"] == (4, 56, 576)


def test_two_gang_jobs_racing_for_three_nodes_never_deadlock(ledger, tmp_path, monkeypatch):
    import threading

    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.pricing.catalog import set_local_price

    prices = set_local_price("h100x8", "1", gpus=8, path=tmp_path / "prices.csv")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    default_catalog.cache_clear()
    for scope in ("acme", "acme/a", "acme/b"):  # a gate admits only in teams someone created
        ledger.config.set_budget(BudgetRule(scope, period_budget_micro=10**9))
    ledger.config.set_pool(_pool(3))
    gate = Gate(ledger, poll_s=0.02)
    job = GpuJob(instance_type="local:h100x8", max_runtime="60s", nodes=2, kill_grace="1s")
    spans: list[str] = []
    admitted: list[str] = []

    def run(name: str) -> None:
        admission = gate.admit(job, f"acme/{name}/s")
        admitted.append(name)
        row = ledger.views.job(admission.job_id)
        assert len(row["placement"].split(",")) == 2  # all its nodes, or none
        if len(admitted) == 1:  # the first in holds its nodes until the other waits
            wait_for(lambda: ledger.views.jobs(states=("queued",)), 60, "the other job to wait")
        time.sleep(0.3)
        gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
        spans.append(admission.job_id)

    racers = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in racers:
        t.start()
    for t in racers:
        t.join(timeout=60)
    assert len(spans) == 2  # both ran: no deadlock
    first, second = sorted(ledger.views.jobs(), key=lambda r: r["admitted_at"])
    assert second["admitted_at"] >= first["settled_at"]  # 2 + 2 nodes never fit in 3 at once
    assert second["admitted_at"] - second["requested_at"] > 0.2  # it waited, holding nothing


@pytest.mark.parametrize("queueing", ["best_effort_fifo", "strict_fifo"])
def test_a_borrowers_wait_never_holds_another_teams_guaranteed_quota(ledger, queueing):
    """Kueue's ClusterQueue admits within its nominal quota whatever waits to borrow: team A
    waiting to borrow two whole nodes does not hold team B's own quota. Within team A its
    queueing setting says: BestEffortFIFO (the default) lets A's next job try, StrictFIFO
    holds it behind A's head."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(3)  # 3 x 8 GPUs
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 12), borrow_pct=50, queueing=queueing),
            TeamQuota("lab-a", "acme/b", proportional(pool, 12), lend_pct=100),
        ],
    )
    b_running, admitted = ledger.queue.request(_job("acme/b/s", nodes=2, gpus=4))
    assert admitted.verdict == "admit"  # 8 of B's 12, 4 on each of two machines
    a_big, waits = ledger.queue.request(_job("acme/a/s", nodes=2, gpus=8))  # 16 > A's 12: borrows
    assert waits.verdict == "wait" and "1 node free" in waits.reason
    b_more, decision = ledger.queue.request(_job("acme/b/s", nodes=1, gpus=4))
    assert decision.verdict == "admit", decision.reason  # within B's quota: never held
    a_small, next_in_a = ledger.queue.request(_job("acme/a/s", nodes=1, gpus=4))
    if queueing == "best_effort_fifo":
        assert next_in_a.verdict == "admit", next_in_a.reason
        ledger.settlements.settle(
            a_small, ended_at=time.time(), outcome="completed", scope="acme/a/s"
        )
    else:
        assert next_in_a.verdict == "wait"
        assert f"waiting behind job {a_big[:8]}" in next_in_a.reason
        assert "the queue of team acme/a in pool lab-a (strict FIFO)" in next_in_a.reason
        ledger.queue.cancel_queued(a_small, "acme/a/s", "test over")
    ledger.queue.cancel_queued(a_big, "acme/a/s", "test over")
    for job_id in (b_running, b_more):
        ledger.settlements.settle(
            job_id, ended_at=time.time(), outcome="completed", scope="acme/b/s"
        )


class _SlowSlots:
    """Prefect's limits on a busy machine: taking slots takes seconds (all else is instant)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def ensure(self, caps) -> None:
        pass

    def acquire(self, scopes, slots) -> str:
        time.sleep(self.seconds)
        return "lease"

    def renew(self, lease_id) -> bool:
        return True

    def release(self, lease_id) -> None:
        pass


def test_a_reclaim_asked_while_a_borrower_takes_its_slots_is_seen_at_once(
    ledger, tmp_path, monkeypatch
):
    """The borrower's watch starts at admission, not once its Prefect slots are taken."""
    import threading

    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.pricing.catalog import set_local_price

    prices = set_local_price("h100x8", "1", gpus=8, path=tmp_path / "prices.csv")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    default_catalog.cache_clear()
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=10_000, period_budget_micro=10**9))
    pool = _pool(1)  # one machine of 8 GPUs, 4 guaranteed to each team
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 4)),
            TeamQuota("lab-a", "acme/b", proportional(pool, 4), borrow_pct=100),
        ],
    )
    gate = Gate(ledger, limits=_SlowSlots(3.0), poll_s=0.02, preempt_poll_s=0.1)
    borrower = GpuJob(instance_type="local:h100x8", max_runtime="60s", priority="low")
    admitted: list = []
    taking = threading.Thread(target=lambda: admitted.append(gate.admit(borrower, "acme/b/s")))
    taking.start()
    while not ledger.views.jobs("acme/b", states=("admitted",)):
        time.sleep(0.05)
    owner, decision = ledger.queue.request(_job("acme/a/s", gpus=4, priority=100))
    assert decision.verdict == "wait" and decision.preempt  # a's own quota, lent to b
    taking.join(timeout=30)
    [admission] = admitted
    assert admission.preempted.is_set()  # already when admit returns: the job stops as it starts
    gate.holding.settle(admission, ended_at=time.time(), outcome="preempted")
    ledger.queue.cancel_queued(owner, "acme/a/s", "test over")


def test_cpu_only_jobs_take_their_vcpu_of_a_cpu_pool_and_never_nothing(ledger, tmp_path):
    """HyperPod allocates CPU partitions down to vCPU: a pool of CPU machines with a team quota
    of 16 vCPU admits four 4-vCPU jobs and queues the fifth; a CPU type priced without its vCPU
    takes a whole machine, more than the quota, and is refused naming the vCPU."""
    from prefect_gpu_budget.pricing.catalog import Catalog, set_local_price

    prices = set_local_price(
        "cpu-box", "0.2", gpus=0, path=tmp_path / "p.csv", vcpu=4, memory_gib=16
    )
    row = Catalog.load(prices).row("local:cpu-box")
    assert (row.gpus, row.vcpu, row.memory_gib) == (0, 4, 16)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = Pool("acme", "cpu", 4, (0, 64, 256), ("local:cpu-box", "local:cpu-any"), "")
    ide = TeamQuota("cpu", "acme/ide", proportional(pool, 0, vcpu=16, memory=64), borrow_pct=0)
    ledger.config.set_pool(pool, [ide])

    def cpu_job(instance: str, vcpu: int, memory: int) -> NewJob:
        return new_job(
            "acme/ide/s",
            instance_type=instance,
            rate_micro_per_hour=200_000,
            rate_cents=20,
            node_gpus=0,
            node_vcpu=vcpu,
            node_memory_gib=memory,
        )

    verdicts = [ledger.queue.request(cpu_job("local:cpu-box", 4, 16))[1] for _ in range(5)]
    assert [d.verdict for d in verdicts] == ["admit"] * 4 + ["wait"]
    assert "uses 16 vCPU of its quota 16 vCPU" in verdicts[-1].reason
    whole = ledger.queue.request(cpu_job("local:cpu-any", 0, 0))[1]
    assert whole.verdict == "reject"
    assert "needs 64 vCPU, more than team acme/ide's quota of 16 vCPU" in whole.reason


def test_partial_node_jobs_share_a_machine_and_pay_their_part(ledger, tmp_path):
    """HyperPod lets a task ask for k GPUs, vCPU and memory of a node: four 2-GPU jobs share one
    8-GPU machine, each paying a quarter of its price and taking a quarter of its vCPU and
    memory; a fifth waits for capacity; a part priced by its largest share; a part larger than
    the machine, or outside any capacity pool, is refused with nothing written."""
    from prefect_gpu_budget.admission.gate import AdmissionRefused
    from prefect_gpu_budget.pricing.catalog import Catalog, set_local_price
    from prefect_gpu_budget.units import BudgetInputError

    prices = tmp_path / "p.csv"
    set_local_price("box8", "16", gpus=8, path=prices, vcpu=64, memory_gib=256)
    set_local_price("loose8", "16", gpus=8, path=prices, vcpu=64, memory_gib=256)
    gate = Gate(ledger, catalog=Catalog.load(prices), poll_s=0.02)
    for scope in ("acme", "acme/a"):  # a gate admits only in teams someone created
        ledger.config.set_budget(BudgetRule(scope, period_budget_micro=10**9))
    ledger.config.set_pool(Pool("acme", "lab", 1, (8, 64, 256), ("local:box8",), "H100"))

    def part(**kw) -> GpuJob:
        return GpuJob(instance_type="local:box8", max_runtime="1h", kill_grace="1s", **kw)

    admitted = [gate.admit(part(gpus=2), "acme/a/s") for _ in range(4)]
    rows = [ledger.views.job(a.job_id) for a in admitted]
    assert {(r["rate_micro_per_hour"], r["node_gpus"], r["node_vcpu"]) for r in rows} == {
        (4_000_000, 2, 16)
    }
    assert {r["node_memory_gib"] for r in rows} == {64}
    with pytest.raises(AdmissionRefused) as waited:
        gate.admit(part(gpus=1, max_wait="1s"), "acme/a/s")
    assert "pool lab" in waited.value.reason
    assert gate.quote(part(gpus=1, vcpu=48)).rate_micro_per_hour == 12_000_000  # 3/4 of it
    assert gate.quote(part(vcpu=16)).rate_micro_per_hour == 4_000_000  # a CPU part, no GPU

    before = len(ledger.views.jobs("acme"))
    with pytest.raises(BudgetInputError, match="asks 9 GPUs, but local:box8 has 8"):
        gate.admit(part(gpus=9), "acme/a/s")
    with pytest.raises(BudgetInputError, match="only in a capacity pool"):
        gate.admit(part(gpus=2).model_copy(update={"instance_type": "local:loose8"}), "acme/a/s")
    with pytest.raises(BudgetInputError, match="must ask for some"):
        gate.admit(part(gpus=0), "acme/a/s")
    assert len(ledger.views.jobs("acme")) == before
    for admission in admitted:
        gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
