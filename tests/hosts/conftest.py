"""The multi-host fixtures: one cluster (two API replicas, the services, Redis, three hosts)
per module, on PostgreSQL databases of the run's own (the ledger and Prefect's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hosts.cluster import Cluster, cluster
from tests.support.postgres import SERVER, fresh_database

HOSTS = 3


@pytest.fixture(scope="module")
def hosts_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hosts")
    with (
        fresh_database(f"{SERVER}/postgres") as ledger_url,
        fresh_database(f"{SERVER}/postgres") as prefect_url,
        cluster(root, hosts=HOSTS, ledger_url=ledger_url, prefect_url=prefect_url) as running,
    ):
        yield running


@pytest.fixture(scope="module")
def host_prices(hosts_cluster: Cluster) -> Path:
    """The price file every host reads: `local:hosts` at $3.60/h (360 cents an hour)."""
    from prefect_gpu_budget.pricing.catalog import set_local_price

    path = hosts_cluster.root / "prices.csv"
    set_local_price("hosts", "3.6", gpus=0, path=path)
    return path


@pytest.fixture(scope="module")
def hosts_ledger(hosts_cluster: Cluster) -> Iterator:
    """The shared ledger, as this (the root) namespace reads it; its tables made here."""
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(hosts_cluster.ledger_url)
    yield ledger
    ledger.db.dispose()
