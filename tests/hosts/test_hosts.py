"""Promise 15, several hosts, one truth: on Prefect's multi-replica server (two API replicas, one
services process, PostgreSQL and Redis) with admitters on three hosts (network and UTS
namespaces of their own: tests/hosts/cluster.py), the caps and the ledger hold as on one; a dead
host's jobs are settled from another host, a live host's never; a dead replica stops no job.

The invariants are read from the ledger's own records (`admission/audit.py`) and from both
replicas' view of Prefect's limits; no figure of time is asserted.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.audit import audit, promise1_violations
from prefect_gpu_budget.admission.ledger import ACTIVE, Ledger
from prefect_gpu_budget.admission.limits import limit_name
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.timing import HEARTBEAT_S, LEASE_S, REPOSSESS_S
from tests.hosts.cluster import (
    Agent,
    Cluster,
    ReplicaSlots,
    _http,
    cli,
    start_agent,
    wait_until,
)

pytestmark = [
    pytest.mark.xdist_group("hosts"),
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("abandoned_lease"),
]

RATE = 360
"""Cents an hour of one `local:hosts` job (tests/hosts/conftest.py prices it)."""
STALE_S = 15
"""The silence after which the test's reconcile takes a host for gone: 15 of the agents' 1 s
heartbeats (the product's default is 120 s of 15 s heartbeats)."""


def _set(ledger: Ledger, rules: list[BudgetRule]) -> None:
    for rule in rules:
        ledger.config.set_budget(rule)


def _host_of(holder: str) -> str:
    return holder.rsplit(":", 2)[0]


def _waiting(ledger: Ledger, scope: str) -> list[dict]:
    return ledger.views.jobs(scope, states=("queued",))


def _marker_job(path: Path) -> list[str]:
    """A job's command that runs until the test creates `path`."""
    return ["sh", "-c", f'while [ ! -e "{path}" ]; do sleep 0.2; done']


def _reconcile(cluster: Cluster, host_index: int, api: str, prices: Path, *args: str) -> dict:
    """`prefect-gpu-budget reconcile --json ARGS` on a host: {job id: action}."""
    done = cli(cluster, cluster.hosts[host_index], api, prices, "reconcile", "--json", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return {d["job_id"]: d["action"] for d in json.loads(done.stdout.strip().splitlines()[-1])}


def _all_settled_once(agents: list[Agent]) -> list[dict]:
    """Every agent ended well; each job it was admitted for settled once (a second settlement
    changed nothing). The agents' lines, all of them."""
    lines = [line for agent in agents for line in agent.finish()]
    admitted = {line["job"] for line in lines if line["e"] == "admitted"}
    settled = [line["job"] for line in lines if line["e"] == "settled"]
    assert sorted(settled) == sorted(admitted)
    again = [line for line in lines if line["e"] == "again"]
    assert len(again) == len(admitted) and not any(line["changed"] for line in again)
    return lines


# -- abandoned lease: started with the module, checked at its end ------------------------------


@pytest.fixture(scope="module")
def abandoned_lease(hosts_cluster: Cluster) -> dict:
    """Slots taken under a lease on replica 0 by a holder that is never heard of again, and no
    ledger row: only the lease's expiry can give them back. Taken once, when the module starts,
    so that the expiry runs while the other tests do (`test_an_abandoned_lease_...`)."""
    first, second = hosts_cluster.apis
    _http(f"{first}/v2/concurrency_limits/", {"name": limit_name("lapse"), "limit": 100})
    taken = _http(
        f"{first}/v2/concurrency_limits/increment-with-lease",
        {"names": [limit_name("lapse")], "slots": 40, "lease_duration": LEASE_S},
    )
    # the other replica renews it: both read one lease store (an in-memory store answers 404)
    _http(
        f"{second}/v2/concurrency_limits/leases/{taken['lease_id']}/renew",
        {"lease_duration": LEASE_S},
    )
    return {"lease_id": taken["lease_id"], "renewed_at": time.time()}


# -- the race ----------------------------------------------------------------------------------

RACE_SCOPES = ["race/a/s1", "race/a/s2", "race/b/s1", "race/b/s2"]
RACE_RULES = [
    BudgetRule("race", hourly_cap_cents=3 * RATE, period_budget_micro=10_000_000),
    BudgetRule("race/a", hourly_cap_cents=2 * RATE, period="week"),
    BudgetRule("race/b", hourly_cap_cents=2 * RATE, period_budget_micro=75_000, period="week"),
    BudgetRule("race/a/s1", hourly_cap_cents=RATE, period="day"),
    BudgetRule("race/a/s2", hourly_cap_cents=2 * RATE),
    BudgetRule("race/b/s1", hourly_cap_cents=2 * RATE),
    BudgetRule("race/b/s2", hourly_cap_cents=RATE),
]
"""Nested caps: at most three jobs in the org, two per team, one in two of the sessions; team
b's week fits two 30-second reservations ($0.031 each) and what its jobs spent."""


def _most_at_once(rows: list[dict]) -> int:
    """The most jobs the ledger held admitted at one instant."""
    events = sorted(
        [(r["admitted_at"], 1) for r in rows if r["admitted_at"]]
        + [(r["settled_at"], -1) for r in rows if r["admitted_at"] and r["settled_at"]],
        key=lambda e: (e[0], e[1]),
    )
    most = count = 0
    for _, step in events:
        count += step
        most = max(most, count)
    return most


class SlotWatch:
    """Reads every `gpu-budget:race...` limit through each replica, over and over, while the
    race runs: the most slots seen in use per limit, and any reading above its limit."""

    def __init__(self, cluster: Cluster, prefix: str) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.most: dict[str, int] = {}
        self.over: list[tuple[str, str, int, int]] = []
        self.readings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for api in self.cluster.apis:
                try:
                    found = self.cluster.limits(api, self.prefix)
                except (OSError, ValueError):
                    continue
                self.readings += 1
                for name, (active, limit) in found.items():
                    self.most[name] = max(self.most.get(name, 0), active)
                    if active > limit:
                        self.over.append((api, name, active, limit))
            self._stop.wait(0.05)

    def __enter__(self) -> SlotWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_processes_on_several_hosts_race_through_both_replicas(
    hosts_cluster: Cluster, hosts_ledger: Ledger, host_prices: Path
):
    cluster, ledger = hosts_cluster, hosts_ledger
    cluster.ensure_replicas()
    _set(ledger, RACE_RULES)
    agents = [
        start_agent(
            cluster,
            host,
            cluster.apis[(h * 2 + i) % 2],  # each host has an agent on either replica
            host_prices,
            scope=RACE_SCOPES[(h * 2 + i) % 4],
            threads=2,
            jobs=3,
            job_s=0.3,
            max_runtime="30s",
            wait_for_go=True,
            name=f"race-{h}-{i}",
        )
        for h, host in enumerate(cluster.hosts)
        for i in range(2)
    ]
    for agent in agents:
        agent.wait_for("ready")
    with SlotWatch(cluster, limit_name("race")) as watch:
        for agent in agents:  # all at once, their imports done
            agent.go()
        _all_settled_once(agents)
        time.sleep(0.3)  # one more reading of both replicas once all is settled

    rows = ledger.views.jobs("race")
    assert len(rows) == 36
    assert all(r["state"] == "settled" and r["outcome"] == "completed" for r in rows), [
        (r["name"], r["state"], r["outcome"], r["reason"]) for r in rows
    ]
    assert promise1_violations(rows, RACE_RULES) == []
    for api in cluster.apis:  # the ledger's audit, with each replica's slots
        found = audit(ledger, ReplicaSlots(cluster, api), scope="race")
        assert found.ok, found.messages
        assert all(active == 0 for active, _ in cluster.limits(api, limit_name("race")).values())
    # Prefect's own count never passed a limit, as either replica read it, and the race did
    # fill the caps (the org's three jobs at once)
    assert watch.readings > 0 and watch.over == []
    assert watch.most.get(limit_name("race"), 0) > 0
    assert _most_at_once(rows) == 3
    # the jobs came from the three hosts apart: one holder name per host
    if cluster.network.apart:
        assert {_host_of(r["holder"]) for r in rows} == {h.name for h in cluster.hosts}


# -- a dead host -------------------------------------------------------------------------------

DEAD_RULES = [
    BudgetRule("dead", hourly_cap_cents=3 * RATE),
    BudgetRule("dead/t", hourly_cap_cents=3 * RATE),
]


def test_a_dead_hosts_jobs_are_settled_from_another_host(
    hosts_cluster: Cluster, hosts_ledger: Ledger, host_prices: Path, tmp_path: Path
):
    cluster, ledger = hosts_cluster, hosts_ledger
    cluster.require_hosts_apart()
    cluster.ensure_replicas()
    _set(ledger, DEAD_RULES)
    first, second = cluster.apis
    dying, living, other = cluster.hosts
    release = tmp_path / "release"
    # host 1 runs two jobs through replica 0, host 2 one through replica 1: the org's cap is full
    runners = start_agent(
        cluster, dying, first, host_prices, scope="dead/t/one", threads=2, job_s=300,
        max_runtime="10m", name="dying",
    )  # fmt: skip
    live = start_agent(
        cluster, living, second, host_prices, scope="dead/t/two", command=_marker_job(release),
        max_runtime="10m", name="living",
    )  # fmt: skip
    runners.wait_for("started", 2)
    live.wait_for("started")
    # and one job more waits on either host: host 1's through replica 0, host 3's through 1
    waiter = start_agent(
        cluster, dying, first, host_prices, scope="dead/t/one", max_wait="10m", name="waits"
    )
    later = start_agent(  # it runs until released, as the living host's job: both counted below
        cluster, other, second, host_prices, scope="dead/t/three", max_wait="10m", name="later",
        command=_marker_job(release), max_runtime="10m",
    )  # fmt: skip
    wait_until(lambda: len(_waiting(ledger, "dead")) == 2, 180, "two jobs waiting")
    # Prefect counts the three (once read 720: host 1's second job had asked early, before its
    # first made the limits, and Prefect granted a lease over limits it did not have)
    cluster.wait_slots("dead", second, 3 * RATE, 5.0, "the three jobs' slots")

    # every host alive: reconcile, from host 3 through replica 1, settles nothing
    assert _reconcile(cluster, 2, second, host_prices, "--stale-after", f"{STALE_S}s") == {}

    killed_at = time.time()
    assert dying.kill() >= 2  # its agents, their jobs' holders and jobs, all at once
    dead_at = time.time()  # a heartbeat may land while the kill goes through the namespace
    gone = {r["id"]: r for r in ledger.views.jobs("dead/t/one")}
    assert len(gone) == 3 and all(r["state"] in ("queued", *ACTIVE) for r in gone.values())
    # a host that has only gone silent is not taken for dead before the stale time (120 s)
    assert _reconcile(cluster, 2, second, host_prices) == {}

    # once its heartbeats are STALE_S old, host 3 settles host 1's jobs, from the ledger's
    # record of them (another host's holder cannot be looked up by pid: identity says None)
    wait_until(
        lambda: all(r["heartbeat_at"] < time.time() - STALE_S - 1 for r in gone.values()),
        120,
        "host 1's rows to fall silent",
        every=1.0,
    )
    done = _reconcile(cluster, 2, second, host_prices, "--stale-after", f"{STALE_S}s")
    assert done == {
        job_id: ("cancelled" if row["state"] == "queued" else "settled")
        for job_id, row in gone.items()
    }
    # what it freed goes to the job waiting on host 3, through replica 1
    later.wait_for("started")
    for row in ledger.views.jobs("dead/t/one"):
        if row["admitted_at"] is None:
            assert row["state"] == "cancelled"
            continue
        assert row["state"] == "settled" and row["outcome"] == "reconciled"
        # charged up to its last heartbeat plus one interval: never past the host's death by more
        assert killed_at - 60 < row["ended_at"] <= dead_at + HEARTBEAT_S
        assert row["actual_micro"] <= row["reserved_micro"]
    # Prefect's slots: the dead host's are back, on either replica: at once where reconcile gave
    # its leases back through replica 1, else once they lapse (a loaded host reconciles late, and
    # a lease near its end is left to Prefect's repossessor: both returning it counts it twice)
    running = sum(r["rate_cents"] for r in ledger.views.jobs("dead", states=ACTIVE))
    assert running == 2 * RATE  # the living host's job, and host 3's
    lapsed = dead_at + LEASE_S + 2 * REPOSSESS_S
    for api in (second, first):
        timeout = max(10.0, lapsed - time.time())
        cluster.wait_slots("dead", api, running, timeout, f"the dead host's slots back on {api}")
    # the living host's job was never touched, and ends as it would have
    release.touch()
    _all_settled_once([live, later])
    assert [line["outcome"] for line in live.events("settled")] == ["completed"]
    assert _reconcile(cluster, 2, second, host_prices, "--stale-after", f"{STALE_S}s") == {}
    for api in cluster.apis:
        found = audit(ledger, ReplicaSlots(cluster, api), scope="dead", stale_after=STALE_S)
        assert found.ok, found.messages
        assert cluster.active_slots("dead", api) == 0
    assert runners.proc.poll() is not None and waiter.proc.poll() is not None


# -- a dead replica ----------------------------------------------------------------------------

LB_RULES = [
    BudgetRule("lb", hourly_cap_cents=2 * RATE),
    BudgetRule("lb/t", hourly_cap_cents=2 * RATE),
]


def test_a_dead_replica_stops_no_job_and_the_other_admits(
    hosts_cluster: Cluster, hosts_ledger: Ledger, host_prices: Path, tmp_path: Path
):
    cluster, ledger = hosts_cluster, hosts_ledger
    cluster.ensure_replicas()
    _set(ledger, LB_RULES)
    release = tmp_path / "release"
    # every agent knows one URL, the load balancer's, as behind the docs' NGINX
    agents = [
        start_agent(
            cluster,
            host,
            cluster.balancer,
            host_prices,
            scope=f"lb/t/{n}",
            threads=2,
            command=_marker_job(release),
            max_runtime="10m",
            name=f"lb-{n}",
        )
        for n, host in enumerate(cluster.hosts)
    ]
    wait_until(
        lambda: (
            sum(len(a.events("started")) for a in agents) == 2 and len(_waiting(ledger, "lb")) == 4
        ),
        180,
        "two jobs running, four waiting",
    )
    running = {r["id"] for r in ledger.views.jobs("lb", states=ACTIVE)}

    killed_at = time.time()
    cluster.replicas[0].kill()
    assert not cluster.replicas[0].healthy()
    time.sleep(2 * 1.0)  # two heartbeats and lease renewals of the running jobs meanwhile
    release.touch()
    _all_settled_once(agents)

    rows = ledger.views.jobs("lb")
    assert len(rows) == 6
    assert all(r["state"] == "settled" and r["outcome"] == "completed" for r in rows), [
        (r["name"], r["state"], r["outcome"], r["reason"]) for r in rows
    ]
    # the jobs that ran through the death went on to their end
    assert all(r["ended_at"] > killed_at for r in rows if r["id"] in running)
    # the jobs that waited were admitted afterwards, through the replica left
    assert all(r["admitted_at"] > killed_at for r in rows if r["id"] not in running)
    survivor = cluster.apis[1]
    found = audit(ledger, ReplicaSlots(cluster, survivor), scope="lb")
    assert found.ok, found.messages
    assert cluster.active_slots("lb", survivor) == 0


# -- the abandoned lease, at the end -----------------------------------------------------------


def test_an_abandoned_lease_lapses_on_every_replica(hosts_cluster: Cluster, abandoned_lease: dict):
    """Slots that no ledger row records (a holder dead between its lease and its record) come
    back when the lease lapses: the services process's repossessor reads the lease store the
    replicas share, whichever replica granted or renewed it."""
    cluster = hosts_cluster
    cluster.ensure_replicas()
    lapse = abandoned_lease["renewed_at"] + LEASE_S + 2 * REPOSSESS_S
    for api in cluster.apis:
        wait_until(
            lambda api=api: cluster.active_slots("lapse", api) == 0,
            max(30.0, lapse + 60 - time.time()),
            f"the abandoned lease's slots back on {api}",
            every=1.0,
        )
    with pytest.raises(urllib.error.HTTPError) as gone:
        _http(
            f"{cluster.apis[1]}/v2/concurrency_limits/leases/{abandoned_lease['lease_id']}/renew",
            {"lease_duration": LEASE_S},
        )
    assert gone.value.code in (404, 410)
