"""The manual's "Several hosts" page (docs/several-hosts.md) names settings that the installed
Prefect and prefect-redis read, with values they can load: a misspelt name is ignored by Prefect
without a word, and a server would quietly keep its leases in memory."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hosts.cluster import server_settings

pytestmark = pytest.mark.xdist_group("hosts")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "several-hosts.md"

READ_BACK = {
    "PREFECT_API_DATABASE_CONNECTION_URL": "server.database.connection_url",
    "PREFECT_API_DATABASE_MIGRATE_ON_START": "server.database.migrate_on_start",
    "PREFECT_MESSAGING_BROKER": "server.events.messaging_broker",
    "PREFECT_MESSAGING_CACHE": "server.events.messaging_cache",
    "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "server.events.causal_ordering",
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "server.concurrency.lease_storage",
    "PREFECT_SERVER_DOCKET_URL": "server.docket.url",
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "server.register_blocks_on_start",
    "PREFECT_API_URL": "api.url",
    "PREFECT_REDIS_MESSAGING_HOST": "redis.host",
    "PREFECT_REDIS_MESSAGING_PORT": "redis.port",
    "PREFECT_REDIS_MESSAGING_DB": "redis.db",
    "PREFECT_REDIS_MESSAGING_USERNAME": "redis.username",
    "PREFECT_REDIS_MESSAGING_PASSWORD": "redis.password",
    "PREFECT_REDIS_MESSAGING_SSL": "redis.ssl",
    "PREFECT_REDIS_MESSAGING_URL": "redis.url",
    "PREFECT_GPU_BUDGET_LEDGER_URL": "gpu_budget.ledger_url",
    "PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL": "gpu_budget.gateway_redis_url",
    "PREFECT_GPU_BUDGET_PRICES": "gpu_budget.prices_path",
    "PREFECT_HOME": "home",
}
"""Where each setting the section may name lands once loaded (`redis.`: prefect-redis's
`RedisMessagingSettings`; `gpu_budget.`: this package's settings)."""

VALUES = {
    "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://prefect@db:5432/prefect",
    "PREFECT_API_DATABASE_MIGRATE_ON_START": "false",
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
    "PREFECT_API_URL": "http://prefect-lb:4200/api",
    "PREFECT_REDIS_MESSAGING_HOST": "redis",
    "PREFECT_REDIS_MESSAGING_PORT": "6380",
    "PREFECT_REDIS_MESSAGING_DB": "3",
    "PREFECT_REDIS_MESSAGING_USERNAME": "someone",
    "PREFECT_REDIS_MESSAGING_PASSWORD": "secret",
    "PREFECT_REDIS_MESSAGING_SSL": "true",
    "PREFECT_REDIS_MESSAGING_URL": "redis://redis:6380/3",
    "PREFECT_SERVER_DOCKET_URL": "redis://redis:6380/4",
    "PREFECT_GPU_BUDGET_LEDGER_URL": "postgresql+psycopg://gpu_budget@db:5432/gpu_budget",
    "PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL": "redis://redis:6380/5",
    "PREFECT_GPU_BUDGET_PRICES": "/srv/gpu-budget/prices.csv",
    "PREFECT_HOME": "/srv/prefect-home",
}
"""A value of each that is not its default (the module settings take the page's own)."""

LOAD = """
import json, os
from prefect.settings import Settings
from prefect_redis.client import RedisMessagingSettings
from prefect_gpu_budget import settings as ours

def dig(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj.get_secret_value() if hasattr(obj, "get_secret_value") else obj

prefect, redis = Settings(), RedisMessagingSettings()
out = {}
for name, path in json.loads(os.environ["READ_BACK"]).items():
    head, _, rest = path.partition(".")
    if head == "redis":
        out[name] = dig(redis, rest)
    elif rest == "ledger_url":
        out[name] = ours.ledger_url(None)
    elif head == "gpu_budget":
        out[name] = getattr(ours, rest)()
    else:
        out[name] = dig(prefect, path)
print(json.dumps(out, default=str))
"""


def _section() -> str:
    """The manual's "Several hosts" page, whole."""
    text = PAGE.read_text()
    assert text.startswith("# Several hosts\n"), text[:100]
    return text


def _named(section: str) -> dict[str, str | None]:
    """Each `PREFECT_...` name the section gives, with the value it sets (None: named only).
    `_USERNAME`-style tails after a full name stand for that name's stem plus the tail."""
    names: dict[str, str | None] = {}
    for name, value in re.findall(r"\b(PREFECT_[A-Z_]+[A-Z])(?:=([^\s`]+))?", section):
        if names.get(name) is None:
            names[name] = value or None
    for stem, tails in re.findall(r"(PREFECT_[A-Z_]+_)[A-Z]+\b((?:, _[A-Z]+)+)", section):
        for tail in re.findall(r"_([A-Z]+)", tails):
            names.setdefault(stem + tail, None)
    return names


def _load(values: dict[str, str], names: list[str]) -> dict[str, object]:
    """What a fresh process of the installed packages loads for `names`, given `values`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(values, READ_BACK=json.dumps({n: READ_BACK[n] for n in names}))
    done = subprocess.run(
        [sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_setting_the_section_names_is_read_by_the_installed_packages() -> None:
    named = _named(_section())
    assert set(server_settings("x", "h", 1, 0, "redis://h:1/1")) <= set(named)
    unknown = set(named) - set(READ_BACK)
    assert not unknown, f"the page names settings nothing here checks: {sorted(unknown)}"
    values = {name: VALUES.get(name) or named[name] or "" for name in named}
    assert all(values.values()), values
    # a Redis URL overrides the discrete fields: each is read in a process of its own
    url = "PREFECT_REDIS_MESSAGING_URL"
    rest = {n: v for n, v in values.items() if n != url}
    loaded = _load(rest, list(rest))
    if url in values:
        loaded.update(_load({url: values[url]}, [url]))
    for name, want in values.items():
        got = loaded[name]
        if isinstance(got, bool):
            assert got == (want.lower() == "true"), name
        else:
            assert str(got).rstrip("/") == want.rstrip("/"), (name, got, want)


@pytest.mark.parametrize(
    ("module", "exports"),
    [
        ("prefect_redis.messaging", ("Publisher", "Consumer", "Cache")),
        ("prefect_redis.ordering", ("CausalOrdering",)),
        ("prefect_redis.lease_storage", ("ConcurrencyLeaseStorage",)),
    ],
)
def test_the_modules_the_section_names_are_the_ones_prefect_loads(
    module: str, exports: tuple[str, ...]
) -> None:
    """Prefect imports the module a setting names and takes these classes from it."""
    assert module in _section()
    loaded = importlib.import_module(module)
    assert all(hasattr(loaded, name) for name in exports)
