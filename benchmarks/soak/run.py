"""The parent's side of a run: a fresh ledger, the Prefect server and its limits, the agents
started together, the run watched (backends, memory, host and database work, vacuums), then
the checks and the analysis put together."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks.harness.host import cpu_steal, rss_mib
from benchmarks.harness.ledger import fresh_ledger
from benchmarks.soak.agents import Agents
from benchmarks.soak.analysis import analyse
from benchmarks.soak.checks import check_ledger, targets
from benchmarks.soak.config import APP_NAME, DRAIN_S, PRICE_USD, Config, budgets, log
from prefect_gpu_budget.admission.ledger import metadata, normalise_url
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.pricing.catalog import set_local_price
from prefect_gpu_budget.testing.postgres import (
    backends,
    database_work,
    name_of,
    postgres_database,
    server_of,
    vacuum,
)
from prefect_gpu_budget.testing.servers import bare_postgres_server, serving


def set_up_ledger(cfg: Config) -> None:
    """The run's ledger: the gate's tables dropped and recreated, the soak's budgets set."""
    ledger = fresh_ledger(cfg.url)
    try:
        for rule in budgets(cfg):
            ledger.config.set_budget(rule)
    finally:
        ledger.db.dispose()  # the parent holds no gate connection during the run


@contextmanager
def work_dir(keep: str | None) -> Iterator[Path]:
    """Where the agents write their samples: `keep`, left in place, or a temporary folder."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix="gate-soak-") as name:
        yield Path(name)


def create_limits(cfg: Config) -> None:
    """Create the Prefect limits once, as a deployment would, before the agents start."""
    limits = RateLimits()
    try:
        limits.ensure(
            (rule.scope, rule.hourly_cap_cents)
            for rule in budgets(cfg)
            if rule.hourly_cap_cents is not None
        )
    finally:
        limits.close()


def db_work(engine: sa.Engine, url: str, prefect_url: str) -> dict[str, list[int]]:
    """Per database (the ledger's and the Prefect server's): cumulative committed transactions
    and rows read (returned + fetched), from `pg_stat_database`."""
    names = [name_of(u) for u in (url, prefect_url)]
    found = database_work(engine, names)
    return {"ledger": found.get(names[0], [0, 0]), "prefect": found.get(names[1], [0, 0])}


def run(cfg: Config) -> dict[str, Any]:
    wall = time.perf_counter()
    set_up_ledger(cfg)
    out: dict[str, Any] = {
        "config": {**asdict(cfg), "url": cfg.url.split("@")[-1]},
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    monitor = sa.create_engine(
        normalise_url(cfg.url), pool_size=1, connect_args={"application_name": "gate-soak-monitor"}
    )
    prefect_db = postgres_database("gate_soak_prefect", server_of(cfg.url))
    with work_dir(cfg.keep) as tmp, prefect_db as prefect_url:
        prices = set_local_price("soak", PRICE_USD, gpus=1, path=tmp / "prices.csv")
        server = bare_postgres_server(tmp / "server-home", prefect_url)
        with server, serving(server.api):
            api_url = server.api
            create_limits(cfg)
            log(f"Prefect server at {api_url}; spawning {cfg.agents} agents")
            agents = Agents(cfg, api_url, prices, tmp)
            try:
                agents.ready(timeout_s=300)
                start = time.time() + 0.5
                end = start + cfg.run_s
                agents.start(start, end)
                until = time.strftime("%H:%M:%S", time.localtime(end))
                log(f"running {cfg.minutes:g} min, until {until}")
                parent = watch(cfg, prefect_url, agents, monitor, server.pid, end)
                out["vacuums"] = sum(1 for s in parent if s.get("vacuum"))
                codes = agents.wait(timeout_s=DRAIN_S + 90)
            finally:
                agents.kill()
            out["agent_exit_codes"] = codes
            out["agent_logs"] = {i: agents.tail(i) for i, c in enumerate(codes) if c != 0}
            records = [load(path) for path in agents.outs]
            out["ledger"] = check_ledger(cfg, records, start)
        out["load_avg_1m_at_end"] = os.getloadavg()[0]
    monitor.dispose()
    out.update(analyse(cfg, records, parent, start, end))
    out["targets"], out["missed"] = targets(out)
    out["wall_s"] = time.perf_counter() - wall
    return out


def watch(
    cfg: Config,
    prefect_url: str,
    agents: Agents,
    monitor: sa.Engine,
    server: int | None,
    end: float,
) -> list[dict[str, Any]]:
    """Sample the gate's PostgreSQL backends and the server's RSS until the run ends.

    A server with autovacuum off (some test machines) lets dead rows pile up in the ledger's
    tables, and every decision slows with them (seen: 45,000 dead rows in 30 minutes, the
    decision's median 6.7 -> 22 ms); production servers vacuum by default, so here the parent
    then vacuums the gate's tables and the Prefect server's database once a minute, as
    autovacuum would (`vacuums` in the JSON)."""
    samples: list[dict[str, Any]] = []
    next_log = time.time() + 60
    with monitor.connect() as conn:
        vacuum = conn.execute(sa.text("SHOW autovacuum")).scalar_one() == "off"
    if vacuum:
        log(
            "autovacuum is off on this server: vacuuming the gate's and Prefect's tables each minute"
        )
    while time.time() < end:
        samples.append(
            {"t": time.time(), "pg": backends(monitor, APP_NAME), "server_mib": rss_mib(server)}
        )
        if len(samples) == 1:
            samples[0].update(cpu=cpu_steal(), db=db_work(monitor, cfg.url, prefect_url))
        dead = agents.dead()
        if dead:
            raise RuntimeError(f"agent {dead[0]} died: {agents.tail(dead[0])}")
        agents.dump_silent(time.time())
        if time.time() > next_log:
            log(f"{(end - time.time()) / 60:.1f} min left")
            next_log += 60
            samples[-1].update(cpu=cpu_steal(), db=db_work(monitor, cfg.url, prefect_url))
            if vacuum:
                vacuum_tables(cfg.url, prefect_url)
                samples[-1]["vacuum"] = True
        time.sleep(min(cfg.sample_s, max(0.0, end - time.time())))
    return samples


def vacuum_tables(url: str, prefect_url: str) -> None:
    """`VACUUM (ANALYZE)` the gate's tables in the ledger's database, and the whole of the Prefect
    server's database (its concurrency-limit rows change on every acquire and release)."""
    vacuum(normalise_url(url), ", ".join(metadata.tables))
    vacuum(normalise_url(prefect_url))


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
