"""The gateway's small hardenings (issue 30, item 6), driven for real where they can be.

Lock-out per (address, token prefix) with a per-address cap; `X-Forwarded-For` believed only
from configured proxies (and never by uvicorn itself); no ledger password on the command line;
no start while PREFECT_HOME or a SQLite ledger is open to other users.

The gateway runs in process over a SQLite ledger with FastAPI's TestClient (whose `client`
sets the socket peer) and the Prefect API pointed at a closed port, as tests/agents/test_gateway.py
does; once as `agents serve`, a real uvicorn on loopback. The CLI runs as a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.support.gateway import GatewayStack, bearer, stale_token
from tests.support.prefect_server import free_port

SESSION, OTHER = "acme/agents/agent-1", "acme/agents/agent-2"
DOWN_API = "http://127.0.0.1:9/api"
PASSWORD = "s3cret-" + secrets.token_hex(4)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    led.config.set_session_template(BudgetRule("acme/agents", hourly_cap_cents=360))
    yield led
    led.db.dispose()


@contextmanager
def _gateway(ledger: Ledger, *peers: str, trusted: str | None = "") -> Iterator[list]:
    """One gateway app, and a TestClient per socket peer (the first runs the app's lifespan;
    the others share its `Door`, and so its limits)."""
    from fastapi.testclient import TestClient
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from prefect_gpu_budget.agents.gateway import create_app

    down = {PREFECT_API_URL: DOWN_API, PREFECT_CLIENT_MAX_RETRIES: 0}
    with temporary_settings(updates=down):
        app = create_app(ledger.url, trusted_proxies=trusted)
        first, *others = (TestClient(app, client=(peer, 40000)) for peer in peers)
        with first:
            yield [first, *others]


# -- lock-out: per (address, token prefix), capped per address ------------------------------


def test_a_bad_token_storm_locks_out_its_client_not_the_other_agents_behind_its_address(ledger):
    token = ledger.grants.grant_agent(SESSION)
    stale = stale_token()
    with _gateway(ledger, "192.0.2.10") as (nat,):
        codes = [nat.get("/v1/status", headers=bearer(stale)).status_code for _ in range(15)]
        assert codes == [401] * 10 + [429] * 5, codes
        refused = nat.get("/v1/status", headers=bearer(stale))
        assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 60
        assert "like this one" in refused.json()["detail"]
        mine = nat.get("/v1/status", headers=bearer(token))  # the same address, another agent
        assert mine.status_code == 200 and mine.json()["session"] == SESSION, mine.text
        # fifteen different bad tokens (below the address's cap) lock out nobody either
        distinct = [nat.get("/v1/status", headers=bearer(stale_token())) for _ in range(15)]
        assert {r.status_code for r in distinct} == {401}
        assert {r.headers["WWW-Authenticate"] for r in distinct} == {"Bearer"}
        assert nat.get("/v1/status", headers=bearer(token)).status_code == 200
        # no token at all counts as its own client: locked out alone
        assert [nat.get("/v1/status").status_code for _ in range(11)][-1] == 429
        assert nat.get("/v1/status", headers=bearer(token)).status_code == 200


def test_past_the_address_cap_bad_tokens_wait_and_valid_ones_still_pass(ledger, monkeypatch):
    """An enumerator behind a shared address (NAT, proxy) slows itself: past the cap its bad
    tokens get 429, while an agent with a valid token behind the same address is served."""
    from prefect_gpu_budget.admission.ledger import Grants
    from prefect_gpu_budget.agents.callers import AUTH_FAILURES_PER_ADDRESS, LOOKUPS_PAST_THE_CAP

    token, other = ledger.grants.grant_agent(SESSION), ledger.grants.grant_agent(OTHER)
    most = AUTH_FAILURES_PER_ADDRESS[0]
    with _gateway(ledger, "192.0.2.20", "192.0.2.21") as (enumerator, neighbour):
        codes = {enumerator.get("/v1/status", headers=bearer(stale_token())).status_code}
        for _ in range(most - 1):
            codes.add(enumerator.get("/v1/status", headers=bearer(stale_token())).status_code)
        assert codes == {401}
        refused = enumerator.get("/v1/status", headers=bearer(stale_token()))
        assert refused.status_code == 429, refused.text
        assert refused.json()["detail"] == "too many bad tokens from this address; wait"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        served = enumerator.get("/v1/status", headers=bearer(token))  # same address
        assert served.status_code == 200, served.text
        assert neighbour.get("/v1/status", headers=bearer(other)).status_code == 200
        # and the storm stays cheap: past the cap, at most 20 tokens a second are looked up
        looked_up, lookup = [], Grants.agent_grant  # the gateway opens a ledger of its own
        monkeypatch.setattr(
            Grants, "agent_grant", lambda g, t: (looked_up.append(t), lookup(g, t))[1]
        )
        began = time.monotonic()
        storm = {
            enumerator.get("/v1/status", headers=bearer(stale_token())).status_code
            for _ in range(100)
        }
        seconds = time.monotonic() - began
        assert storm == {429}
        assert 0 < len(looked_up) <= LOOKUPS_PAST_THE_CAP[0] * (seconds + 1), (
            len(looked_up),
            seconds,
        )
        time.sleep(LOOKUPS_PAST_THE_CAP[1] * 1.1)  # between storms, a valid token gets through
        assert enumerator.get("/v1/status", headers=bearer(token)).status_code == 200


def test_ipv6_clients_are_capped_per_64_and_mapped_ipv4_as_ipv4():
    from prefect_gpu_budget.agents.throttle import address_key

    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9")
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7" == address_key("192.0.2.7")
    assert address_key("testclient") == "testclient"


def test_the_window_sweeps_keys_seen_once_and_says_when_it_has_room():
    from prefect_gpu_budget.agents.throttle import Window

    brief = Window(1, 0.05)
    for n in range(50):  # a storm of one-off keys
        brief.hit(("192.0.2.1", f"gpub_{n}"))
    time.sleep(0.1)
    brief.hit("last")
    assert list(brief._seen) == ["last"]
    window = Window(2, 30.0)
    assert window.retry_after("k") == 1
    window.hit("k"), window.hit("k")
    assert window.full("k") and 29 <= window.retry_after("k") <= 30


# -- X-Forwarded-For: from trusted proxies only ---------------------------------------------


def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(ledger):
    token, stale = ledger.grants.grant_agent(SESSION), stale_token()
    with _gateway(ledger, "192.0.2.30") as (client,):
        for n in range(10):  # each claims another origin: the peer is what counts
            spoofed = bearer(stale, **{"X-Forwarded-For": f"198.51.100.{n}"})
            assert client.get("/v1/status", headers=spoofed).status_code == 401
        fresh = bearer(stale, **{"X-Forwarded-For": "198.51.100.99"})
        assert client.get("/v1/status", headers=fresh).status_code == 429
        assert client.get("/v1/status", headers=bearer(token)).status_code == 200


def test_x_forwarded_for_from_a_trusted_proxy_is_honoured(ledger):
    stale = stale_token()
    with _gateway(ledger, "10.9.0.1", "192.0.2.40", trusted="10.9.0.0/16, 10.8.0.7") as (
        proxy,
        direct,
    ):

        def via(chain: str) -> int:
            headers = bearer(stale, **{"X-Forwarded-For": chain})
            return proxy.get("/v1/status", headers=headers).status_code

        assert [via("203.0.113.7") for _ in range(10)] == [401] * 10
        assert via("203.0.113.7") == 429  # that client is locked out...
        assert via("203.0.113.8") == 401  # ...the proxy's other clients are not
        assert via("203.0.113.8, 203.0.113.7") == 429  # a hop the client wrote is not believed
        assert via("203.0.113.7, 10.8.0.7") == 429  # through two trusted proxies: the client
        mcp = proxy.post(  # the MCP door sees the same client
            "/mcp", json={}, headers=bearer(stale, **{"X-Forwarded-For": "203.0.113.7"})
        )
        assert mcp.status_code == 429 and "Retry-After" in mcp.headers, mcp.text
        # a peer outside the trusted networks is its own client, whatever it claims
        for _ in range(10):
            spoofed = bearer(stale, **{"X-Forwarded-For": "203.0.113.99"})
            assert direct.get("/v1/status", headers=spoofed).status_code == 401
        assert via("203.0.113.99") == 401


def test_the_client_address_is_the_rightmost_hop_no_trusted_proxy_wrote():
    from prefect_gpu_budget.agents.gateway import client_address
    from prefect_gpu_budget.settings import gateway_trusted_proxies

    trusted = gateway_trusted_proxies("10.0.0.0/8,2001:db8::1")
    assert client_address("192.0.2.1", ["203.0.113.5"], trusted) == "192.0.2.1"
    assert client_address("10.0.0.2", [], trusted) == "10.0.0.2"
    assert client_address("10.0.0.2", ["1.1.1.1, 203.0.113.5"], trusted) == "203.0.113.5"
    assert client_address("10.0.0.2", ["1.1.1.1", "203.0.113.5, 10.1.1.1"], trusted) == (
        "203.0.113.5"
    )
    assert client_address("10.0.0.2", ["203.0.113.5:4711"], trusted) == "203.0.113.5"
    assert client_address("2001:db8::1", ["[2001:db8::7]:443"], trusted) == "2001:db8::7"
    assert client_address("::ffff:10.0.0.2", ["203.0.113.5"], trusted) == "203.0.113.5"
    assert client_address("10.0.0.2", ["203.0.113.5, not-an-ip"], trusted) == "10.0.0.2"
    assert client_address("10.0.0.2", ["10.0.0.3, 10.0.0.4"], trusted) == "10.0.0.3"
    with pytest.raises(ValueError, match="PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES.*'nope'"):
        gateway_trusted_proxies("10.0.0.1, nope")


# -- secrets never from argv -----------------------------------------------------------------


def test_url_passwords_are_found_where_the_ledger_would_read_them():
    from prefect_gpu_budget.settings import url_has_password

    for url in (
        "postgresql://u:secret@h/db",
        "postgresql+psycopg://u:p@ss/word@h:5432/db",
        "postgresql://u@h/db?sslmode=require&password=secret",
    ):
        assert url_has_password(url), url
    for url in (
        "postgresql://u@h/db",
        "postgresql://u:@h/db",
        "postgresql://h/db?user=u",
        "sqlite:////tmp/a:b@c.db",
    ):
        assert not url_has_password(url), url


def _env(home: Path, **more: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_GPU_BUDGET_", "PREFECT_API_", "PREFECT_PROFILE"))
    }
    return {
        **env,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": DOWN_API,
        "PREFECT_CLIENT_MAX_RETRIES": "0",
        **more,
    }


def _cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line_error(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


@pytest.fixture
def private_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return home


@pytest.mark.parametrize("where", ["command", "app"])
def test_a_ledger_password_on_the_command_line_is_refused(tmp_path, private_home, where):
    url = f"postgresql://u:{PASSWORD}@127.0.0.1:9/db"
    args = ["agents", "serve", "--ledger-url", url]
    if where == "app":  # `prefect-gpu-budget --ledger-url URL agents serve`
        args = ["--ledger-url", url, "agents", "serve"]
    line = _one_line_error(_cli(_env(private_home), tmp_path, *args))
    assert "PREFECT_GPU_BUDGET_LEDGER_URL" in line and "--ledger-url-file" in line, line
    assert PASSWORD not in line


def test_a_ledger_url_file_with_a_password_must_be_private(tmp_path, private_home):
    holder = tmp_path / "ledger-url"
    holder.write_text(f"postgresql://u:{PASSWORD}@127.0.0.1:9/db\n")
    holder.chmod(0o640)
    line = _one_line_error(
        _cli(_env(private_home), tmp_path, "agents", "serve", "--ledger-url-file", str(holder))
    )
    assert f"chmod 600 {holder}" in line and PASSWORD not in line, line
    missing = tmp_path / "absent"
    line = _one_line_error(
        _cli(_env(private_home), tmp_path, "agents", "serve", "--ledger-url-file", str(missing))
    )
    assert str(missing) in line, line


# -- no start while PREFECT_HOME or the ledger is open to others -----------------------------


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder others can reach (pytest's own tmp folders are 0700, which closes everything
    under them): a fresh one in the system temp dir, made 0711."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-budget-hardening-"))
    folder.chmod(0o711)
    if any(not p.stat().st_mode & 0o001 for p in folder.resolve().parents):
        shutil.rmtree(folder)
        pytest.skip("the system temp dir is not reachable by other users here")
    yield folder
    shutil.rmtree(folder)


def _sqlite(path: Path, mode: int) -> str:
    led = Ledger(f"sqlite:///{path}")
    led.db.dispose()
    for leftover in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        leftover.unlink(missing_ok=True)
    path.chmod(mode)
    return f"sqlite:///{path}"


def _not_ours(path: Path) -> int:
    """Make `path` another user's (nobody's, as root); skip where this user cannot."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(path, 65534, 65534)
    return 65534


def _first_line(env: dict[str, str], cwd: Path, *args: str) -> str:
    """The first line a serving command writes on stderr; then it is stopped."""
    served = subprocess.Popen(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        return served.stderr.readline().rstrip("\n")
    finally:
        os.killpg(served.pid, 9)
        served.wait(timeout=30)
        served.stderr.close()


def test_serve_makes_its_own_prefect_home_private_and_refuses_another_users(open_folder):
    """A home is made 0755 by default: `serve` closes one of this user's itself, in one line,
    and starts; one that belongs to another user it refuses, in one line that says whose."""
    home = open_folder / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    env = _env(home, PREFECT_GPU_BUDGET_LEDGER_URL=_sqlite(home / "ledger.db", 0o600))
    first = _first_line(env, open_folder, "serve")
    assert first == (
        f"PREFECT_HOME {home} was open to other users (mode 0755, others: 005): made it 0700"
    )
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    home.chmod(0o755)
    owner = _not_ours(home)
    line = _one_line_error(_cli(env, open_folder, "serve"))
    assert f"PREFECT_HOME {home} is open to other users" in line, line
    assert f"belongs to uid {owner}, not to this user: its owner can chmod 700 {home}" in line
    assert "--allow-shared-home" in line and "ledger file" not in line, line
    assert stat.S_IMODE(home.stat().st_mode) == 0o755  # another user's is left as it is


def test_agents_serve_makes_its_own_sqlite_ledger_private_and_refuses_another_users(
    open_folder, tmp_path
):
    home = open_folder / "home"
    home.mkdir(mode=0o700)
    ledger_file = open_folder / "ledger.db"
    led = _sqlite(ledger_file, 0o644)
    # a bad proxy list stops it right after the check: nothing serves
    env = _env(home, PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES="nope")
    run = _cli(env, tmp_path, "agents", "serve", "--ledger-url", led)  # honoured
    assert run.returncode == 2, run.stderr
    said, error = run.stderr.strip().splitlines()
    assert (
        said == f"the ledger file {ledger_file} was open to other users (mode 0644): made it 0600"
    )
    assert "'nope'" in error and stat.S_IMODE(ledger_file.stat().st_mode) == 0o600
    ledger_file.chmod(0o644)
    owner = _not_ours(ledger_file)
    line = _one_line_error(_cli(_env(home), tmp_path, "agents", "serve", "--ledger-url", led))
    assert f"the ledger file {ledger_file} is open to other users (mode 0644)" in line, line
    assert (
        f"belongs to uid {owner}, not to this user: its owner can chmod 600 {ledger_file}" in line
    )
    assert "PREFECT_HOME" not in line, line
    holder = tmp_path / "ledger-url"  # the same URL from a file
    holder.write_text(led)
    again = _cli(_env(home), tmp_path, "agents", "serve", "--ledger-url-file", str(holder))
    assert _one_line_error(again) == line


def test_allowed_shared_state_is_a_loud_warning(open_folder, tmp_path):
    home = open_folder / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    led = _sqlite(open_folder / "ledger.db", 0o644)
    # a bad proxy list stops it right after the check: nothing serves
    env = _env(home, PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES="10.0.0.1,nope")
    for how, extra in (("flag", {}), ("env", {"PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME": "1"})):
        args = ["agents", "serve", "--ledger-url", led]
        run = _cli({**env, **extra}, tmp_path, *args, *(["--allow-shared-home"] * (how == "flag")))
        assert run.returncode == 2, run.stderr
        warning, error = run.stderr.strip().splitlines()
        assert warning.startswith("WARNING: running with shared state") and "chmod 700" in warning
        assert "chmod 600" in warning and "'nope'" in error, run.stderr


def test_serving_agents_over_a_ledger_that_trusts_everyone_says_so_in_one_line(
    tmp_path, private_home
):
    """The test machines' PostgreSQL trusts local connections, as many do: `agents serve` and
    `serve` start, with one line that says so and how to close it; a URL's password is never
    shown; a database that asks for a password (or cannot be reached) gets no line."""
    from tests.conftest import PG_URL
    from tests.support.postgres import fresh_database

    with fresh_database(PG_URL) as plain:
        url = plain.replace("//postgres@", "//postgres:pw-planted-here@")
        # a bad proxy list stops `agents serve` right after its checks: nothing serves
        env = _env(private_home, PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES="nope")
        run = _cli(env, tmp_path, "agents", "serve", "--ledger-url", plain)
        assert run.returncode == 2, run.stderr
        warning, error = run.stderr.strip().splitlines()
        assert warning.startswith("WARNING: the ledger's database") and "'nope'" in error
        assert "without a password" in warning and "scram-sha-256" in warning, warning
        served = subprocess.Popen(
            [sys.executable, "-m", "prefect_gpu_budget.cli", "serve"],
            env=_env(private_home, PREFECT_GPU_BUDGET_LEDGER_URL=url, PREFECT_API_URL=DOWN_API),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            first = served.stderr.readline()
        finally:
            os.killpg(served.pid, 9)
            served.wait(timeout=30)
            served.stderr.close()
        assert first.startswith("WARNING: the ledger's database"), first
        assert "pw-planted-here" not in first and "postgres@127.0.0.1" in first, first
    closed = plain.rsplit("@", 1)[0] + f"@127.0.0.1:{free_port()}/nothing"
    run = _cli(env, tmp_path, "agents", "serve", "--ledger-url", closed)
    assert "WARNING" not in run.stderr, run.stderr


@contextlib.contextmanager
def _scram_over_tcp():
    """A PostgreSQL of its own that asks every TCP connection for a password (scram-sha-256)
    and trusts its local users: (the cluster, the ledger's URL with the password), once a bare
    TCP login is refused."""
    import sqlalchemy as sa

    from prefect_gpu_budget.admission.ledger.passwordless import passwordless_login
    from tests.support.postgres import private_cluster

    with private_cluster() as cluster:
        with sa.create_engine(
            cluster.server.replace("postgresql:", "postgresql+psycopg:")
        ).begin() as conn:
            conn.exec_driver_sql("ALTER USER postgres PASSWORD 'pw-scram'")
        hba = cluster.folder / "data" / "pg_hba.conf"
        hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        cluster._pg_ctl("reload")
        url = cluster.server.replace("postgres@", "postgres:pw-scram@") + "/postgres"
        deadline = time.monotonic() + 60
        while passwordless_login(url) is not None:  # the reload may take a moment
            assert time.monotonic() < deadline, "the server still trusts a bare login"
            time.sleep(0.2)
        yield cluster, url


def test_a_ledger_that_asks_for_a_password_gets_no_warning():
    """A PostgreSQL of its own that asks every TCP connection for a password (scram-sha-256):
    the ledger's URL, password included, reaches it; without the password nothing does, so no
    warning."""
    from prefect_gpu_budget.admission.ledger.passwordless import passwordless_login

    with _scram_over_tcp() as (cluster, url):
        assert Ledger(url).views.jobs() == []  # with its password: in
        assert passwordless_login(cluster.server + "/postgres") is None


def test_the_ledger_line_names_each_road_in_and_what_the_jobs_reach():
    """A PostgreSQL of its own that asks for a password over TCP but trusts its local users
    (Debian's stock `local` lines do, for `trust`): the start-up line names the socket, not
    TCP, and says the jobs reach neither road, unless they run on the host's network."""
    from prefect_gpu_budget.admission.ledger.passwordless import passwordless_socket
    from prefect_gpu_budget.cli.agent import _exposure_lines

    with _scram_over_tcp() as (cluster, url):
        socket = str(cluster.folder / f".s.PGSQL.{cluster.port}")
        assert passwordless_socket(url) == socket
        (line,) = _exposure_lines(url, "none")
        assert f"without a password through its socket {socket}:" in line, line
        assert "over TCP" not in line and "pw-scram" not in line, line
        assert "reach it by neither road" in line and "peer" in line, line
        host, line = _exposure_lines(url, "host")
        assert host.startswith("WARNING: PREFECT_GPU_BUDGET_AGENT_NETWORK=host:"), host
        assert "unix sockets" in host and "reach it too" in line, line
        hba = cluster.folder / "data" / "pg_hba.conf"
        hba.write_text("local all all scram-sha-256\nhost all all 127.0.0.1/32 scram-sha-256\n")
        cluster._pg_ctl("reload")
        deadline = time.monotonic() + 60
        while passwordless_socket(url) is not None:
            assert time.monotonic() < deadline, "the server still trusts its local users"
            time.sleep(0.2)
        assert _exposure_lines(url, "none") == []


def test_the_startup_check_passes_private_state_and_knows_closed_folders(
    open_folder, tmp_path, monkeypatch
):
    from prefect_gpu_budget.settings import SharedStateError, check_private_state

    monkeypatch.delenv("PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME", raising=False)
    monkeypatch.delenv("PREFECT_GPU_BUDGET_LEDGER_URL", raising=False)
    home = open_folder / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("PREFECT_HOME", str(home))
    led = _sqlite(home / "ledger.db", 0o600)
    assert check_private_state(led) is None
    home.chmod(0o755)
    with pytest.raises(SharedStateError, match=f"chmod 700 {home}"):
        check_private_state(led)
    assert "chmod 700" in check_private_state(led, allow_shared=True)
    monkeypatch.setenv("PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME", "1")
    assert "chmod 700" in check_private_state(led)
    monkeypatch.delenv("PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME")
    home.chmod(0o700)
    (home / "ledger.db").chmod(0o640)  # group-readable, in a folder only its owner passes
    assert check_private_state(led) is None
    shared = _sqlite(open_folder / "shared.db", 0o640)
    with pytest.raises(SharedStateError, match="mode 0640"):
        check_private_state(shared)
    assert check_private_state("postgresql://u@127.0.0.1:9/db") is None
    assert check_private_state(f"sqlite:///{open_folder / 'not-yet.db'}") is None
    closed = tmp_path / "home"  # 0755, but under pytest's 0700 folders: nobody else passes
    closed.mkdir(mode=0o755)
    closed.chmod(0o755)
    monkeypatch.setenv("PREFECT_HOME", str(closed))
    assert check_private_state(_sqlite(closed / "ledger.db", 0o644)) is None


# -- the real thing: `agents serve` on loopback -----------------------------------------------


def _get(base: str, path: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_agents_serve_honours_its_ledger_url_and_uvicorn_believes_no_forwarded_header(
    tmp_path, private_home, ledger
):
    token, stale = ledger.grants.grant_agent(SESSION), stale_token()
    gateway = GatewayStack(
        _env(private_home), tmp_path, serve=False, args=["--ledger-url", ledger.url]
    )
    with gateway as stack:
        base = stack.base
        assert _get(base, "/v1/status", bearer(token)) == 200  # this ledger's token
        for n in range(10):  # uvicorn would have believed these from 127.0.0.1
            spoofed = bearer(stale, **{"X-Forwarded-For": f"198.51.100.{n}"})
            assert _get(base, "/v1/status", spoofed) == 401
        assert _get(base, "/v1/status", bearer(stale, **{"X-Forwarded-For": "1.2.3.4"})) == 429
        assert _get(base, "/v1/status", bearer(token)) == 200
    mode = stat.S_IMODE(private_home.stat().st_mode)
    assert mode == 0o700  # the check changes nothing


def test_long_polls_wait_at_most_two_per_grant_and_never_take_every_thread():
    """A grant's third concurrent long poll answers at once, as does any past the gateway's
    total: waiting reads hold server threads, and the other calls need some."""
    from prefect_gpu_budget.agents.callers import Caller
    from prefect_gpu_budget.agents.door import LONG_POLLS, Door
    from prefect_gpu_budget.agents.throttle import Slots

    door = Door(ledger=None)  # type: ignore[arg-type]
    done = threading.Event()
    door._own_run = lambda caller, run_id: run_id  # type: ignore[method-assign]
    door._sweep_view = lambda run, session: {  # type: ignore[method-assign]
        "state": "Completed" if done.is_set() else "Running"
    }
    caller = Caller("acme/ml/agent-1", "grant-1")
    answers: list[str] = []
    polls = [
        threading.Thread(target=lambda: answers.append(door.sweep(caller, "r", 30)["state"]))
        for _ in range(5)
    ]
    for poll in polls:
        poll.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (  # a thread that answered may not have ended yet
        len(answers) < 5 - LONG_POLLS[0] or sum(poll.is_alive() for poll in polls) > LONG_POLLS[0]
    ):
        time.sleep(0.05)
    assert answers == ["Running"] * (5 - LONG_POLLS[0])  # answered at once, nothing changed
    assert sum(poll.is_alive() for poll in polls) == LONG_POLLS[0]
    done.set()  # the sweep ends: the waiting two answer
    for poll in polls:
        poll.join(timeout=10)
    assert answers[-LONG_POLLS[0] :] == ["Completed"] * LONG_POLLS[0]
    assert door.long_polls._held == {}

    slots = Slots(per_key=2, total=3)
    assert [slots.take(k) for k in ("a", "a", "a", "b", "c")] == [True, True, False, True, False]
    slots.give("a")
    assert slots.take("c") and not slots.take("b")


def test_agents_results_root_is_the_workers_alone(tmp_path, monkeypatch):
    """Other users (the sessions' users run the agents' jobs) cannot read any session's
    results from the disk: the root is made, or tightened, to 0700."""
    from prefect_gpu_budget.agents.limits import agent_results
    from prefect_gpu_budget.settings import AGENT_RESULTS_ENV

    root = tmp_path / "shared" / "results"
    monkeypatch.setenv(AGENT_RESULTS_ENV, str(root))
    assert agent_results("acme/ml/agent-1") == root / "acme" / "ml" / "agent-1"
    assert root.stat().st_mode & 0o777 == 0o700
    root.chmod(0o755)  # an admin's chmod, or an older version's folder
    agent_results("acme/ml/agent-2")
    assert root.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize(
    ("state", "became"), [("SCHEDULED", "CANCELLED"), ("RUNNING", "CANCELLING")]
)
def test_cancelling_a_sweep_before_it_opens_holds(ledger, state, became):
    """Cancelled before its flow recorded it: a scheduled run is Cancelled outright; a run a
    process may already hold is set Cancelling (its worker stops the process, as Prefect's own
    cancel does, never a forced Cancelled that leaves it running), and the cancel is kept for
    when its flow opens the sweep, which then starts no trial."""
    from prefect.client.schemas.objects import State, StateType

    from prefect_gpu_budget.agents.callers import Caller
    from prefect_gpu_budget.agents.door import Door

    run_id = str(uuid.uuid4())
    set_to: list[tuple[str, bool]] = []

    class Prefect:
        def read_flow_run(self, _):
            return SimpleNamespace(
                id=run_id, parameters={"session": SESSION}, state=State(type=StateType[state])
            )

        def set_flow_run_state(self, _, new, force=False):
            set_to.append((new.type.value, force))

    door = Door(ledger, Prefect())
    door.cancel_sweep(Caller(SESSION, "grant"), run_id)
    assert set_to == [(became, became == "CANCELLED")]
    records = ledger.sweeps
    records.open_sweep(run_id, SESSION, "late", "loss", "min", [{"lr": 0.1}])
    assert records.cancelled(run_id)  # the flow's recorder reads this before each trial
