"""Team governance as HyperPod documents it: proportional quotas, lending and borrowing, fair
share of idle capacity, gang fit, preemption victims (the pure part of the decision)."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules import preemption
from prefect_gpu_budget.admission.rules.quota import Shape, TeamQuota, proportional
from tests.admission.rules.pools import admit as _admit
from tests.admission.rules.pools import capacity as _capacity
from tests.admission.rules.pools import job as _job
from tests.admission.rules.pools import pool as _pool


def test_accelerators_alone_bring_their_share_of_vcpu_and_memory():
    pool = _pool(nodes=4)  # 32 GPUs
    assert proportional(pool, 16) == (16, 384, 4096)  # 16 of 32 GPUs: half the vCPU and memory
    assert proportional(pool, 2) == (2, 48, 512)  # k of G per instance: 2/8 of 192 vCPU, 2 TiB
    assert proportional(pool, 2, vcpu=10) == (2, 10, 512)  # explicit values override


def test_lending_and_borrowing_stay_within_their_limits():
    pool = _pool(nodes=2)  # 16 GPUs
    a = TeamQuota("lab-a", "acme/a", proportional(pool, 8), borrow_pct=50)
    b = TeamQuota("lab-a", "acme/b", proportional(pool, 8), lend_pct=25)  # lends at most 2
    cap = _capacity(pool, [a, b])
    for i in range(8):
        assert _admit(cap, f"a{i}", _job("acme/a", 1))
    assert _admit(cap, "a8", _job("acme/a", 1))  # borrowed from b's idle quota
    assert _admit(cap, "a9", _job("acme/a", 1))
    fit = preemption.fit(cap, _job("acme/a", 1), 0)  # b lends only 25% of its 8
    assert not fit.ok and fit.reason == (
        "team acme/a uses 10 H100 of its quota 8 H100 in pool lab-a and this job would borrow "
        "1 H100; other teams lend 0 H100 idle now"
    )
    b_all = TeamQuota("lab-a", "acme/b", proportional(pool, 8), lend_pct=100)
    cap = _capacity(pool, [a, b_all], cap.placed)
    assert _admit(cap, "a10", _job("acme/a", 1)) and _admit(cap, "a11", _job("acme/a", 1))
    fit = preemption.fit(cap, _job("acme/a", 1), 0)  # 12 used = quota 8 + 50%: the borrow limit
    assert not fit.ok and "+50% borrow limit" in fit.reason
    assert cap.never_fits(_job("acme/a", 8, nodes=2)) is not None  # 16 > 8 + 50%
    assert "borrow limit" in cap.never_fits(_job("acme/a", 8, nodes=2))
    [sa, sb] = cap.status("lab-a")
    assert sa["borrowed"][0] == 4 and sb["used"][0] == 0 and sb["lendable"][0] == 8
    assert sb["lent"][0] == 4 and sa["lent"][0] == 0


def test_idle_capacity_is_shared_by_fair_share_weight():
    pool = _pool(nodes=12, node=(1, 24, 256))  # twelve one-GPU machines
    quotas = [
        TeamQuota("lab-a", "acme/a", (2, 48, 512), borrow_pct=1000, weight=60),
        TeamQuota("lab-a", "acme/b", (2, 48, 512), borrow_pct=1000, weight=30),
        TeamQuota("lab-a", "acme/c", (8, 192, 2048), weight=50),  # idle: lends all 8
    ]
    cap = _capacity(pool, quotas)
    waiting = {"acme/a": 10, "acme/b": 10}
    shape = {t: Shape("lab-a", t, (1, 24, 256), 1) for t in waiting}
    n = 0
    while True:  # what the decision does: the team with the least borrowed per weight first
        wanting = [t for t in waiting if waiting[t] and preemption.fit(cap, shape[t], 0).ok]
        if not wanting:
            break
        team = min(wanting, key=lambda t: (cap.share("lab-a", t), t))
        assert _admit(cap, f"j{n}", shape[team])
        waiting[team] -= 1
        n += 1
    borrowed = {s["team"]: s["borrowed"][0] for s in cap.status("lab-a")}
    assert borrowed["acme/a"] + borrowed["acme/b"] == 8
    assert (borrowed["acme/a"], borrowed["acme/b"]) in ((5, 3), (6, 2))  # 2:1 of 8, rounded


def test_two_gang_jobs_for_three_free_nodes_never_hold_part_of_them():
    pool = _pool(nodes=3)
    cap = _capacity(pool, [])
    first, second = _job(None, 8, nodes=2), _job(None, 8, nodes=2)
    assert _admit(cap, "first", first)
    fit = preemption.fit(cap, second, 0)
    assert not fit.ok and fit.placement == ()
    assert fit.reason == "waiting for 2 x 8 H100 in pool lab-a: 1 node free"
    assert len(cap.placed) == 1  # nothing of the second job is held while it waits
    cap.placed = [p for p in cap.placed if p.job_id != "first"]
    assert _admit(cap, "second", second)


def test_a_team_with_no_quota_in_a_governed_pool_never_fits():
    pool = _pool(nodes=1)
    cap = _capacity(pool, [TeamQuota("lab-a", "acme/a", proportional(pool, 8))])
    assert "no quota" in cap.never_fits(_job("acme/z", 1))
    assert "nodes asked" in cap.never_fits(_job("acme/a", 8, nodes=2))


def test_a_refusal_names_the_resource_that_binds_with_the_amounts():
    """Quota 2 GPUs and 10 vCPU: a 2-GPU job that needs 48 vCPU is refused for its vCPU."""
    pool = _pool(nodes=2)
    team = TeamQuota("lab-a", "acme/a", proportional(pool, 2, vcpu=10), borrow_pct=0)
    cap = _capacity(pool, [team])
    needs_cpu = Shape("lab-a", "acme/a", (2, 48, 256), 1)
    assert cap.never_fits(needs_cpu) == (
        "needs 48 vCPU, more than team acme/a's quota of 10 vCPU in pool lab-a"
    )
    needs_gpus = Shape("lab-a", "acme/a", (4, 8, 256), 1)
    assert cap.never_fits(needs_gpus).startswith(
        "needs 4 H100, more than team acme/a's quota of 2 H100"
    )
    needs_memory = Shape("lab-a", "acme/a", (1, 4, 1000), 1)
    assert "needs 1000 GiB of memory, more than" in cap.never_fits(needs_memory)
    too_big = Shape("lab-a", "acme/a", (1, 4, 4000), 1)
    assert cap.never_fits(too_big) == (
        "one node of this job needs 4000 GiB of memory, more than a machine of pool lab-a has "
        "(2048 GiB of memory)"
    )
    assert _admit(cap, "small", Shape("lab-a", "acme/a", (0, 8, 64), 1))
    fit = preemption.fit(cap, Shape("lab-a", "acme/a", (0, 4, 64), 1), 0)  # 8 + 4 vCPU > 10
    assert not fit.ok and "uses 8 vCPU of its quota 10 vCPU" in fit.reason
    assert "this job needs 4 vCPU" in fit.reason
