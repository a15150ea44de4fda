"""The Prefect edge: an answer that is not an outage fails the request, gives the reservation
back and never retries past the job's max wait."""

from __future__ import annotations

import re

import httpx
import pytest
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

from prefect_gpu_budget.admission import limits
from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.limits import (
    PROMPT_RETRY_S,
    REPEATED_5XX,
    DependencyDown,
    LimitsMissing,
    RateLimits,
    limit_name,
)
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog


def _http_error(status: int, detail: str) -> PrefectHTTPStatusError:
    request = httpx.Request("POST", "http://prefect.invalid/api/v2/concurrency_limits/")
    response = httpx.Response(status, json={"detail": detail}, request=request)
    return PrefectHTTPStatusError.from_httpx_error(
        httpx.HTTPStatusError(detail, request=request, response=response)
    )


class _FailingClient:
    """A Prefect client whose every attempt to create a concurrency limit fails with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.creates = 0

    def read_global_concurrency_limit_by_name(self, name: str):
        raise ObjectNotFound(http_exc=Exception(name))

    def create_global_concurrency_limit(self, limit) -> None:
        self.creates += 1
        raise self.error

    def increment_concurrency_slots_with_lease(self, **kwargs):
        raise AssertionError("no slots without a limit")


def _admit(ledger, prices, client: _FailingClient, **job: object) -> AdmissionRefused:
    ledger.config.set_budget(BudgetRule("pf", hourly_cap_cents=720, period_budget_micro=10**8))
    gate = Gate(ledger, RateLimits(client), catalog=Catalog.load(prices))
    with pytest.raises(AdmissionRefused) as refused:
        gate.admit(GpuJob(instance_type="local:box", max_runtime="1h", **job), "pf/t")
    return refused.value


def _given_back(ledger, state: str) -> None:
    (row,) = ledger.views.jobs("pf")
    assert row["state"] == state and row["reserved_micro"] == 0 and row["lease_id"] is None
    assert [s["reserved_micro"] for s in ledger.views.status("pf")] == [0]


def test_a_5xx_that_repeats_for_the_same_request_fails_it(ledger, prices, monkeypatch):
    monkeypatch.setattr(limits, "REPEATED_5XX_SPAN_S", 0.5)
    client = _FailingClient(_http_error(503, "integer out of range"))
    refused = _admit(ledger, prices, client, max_wait="1h")
    assert refused.state_name == "PrefectRefused"
    assert re.search(r"answered 503 \d+ times in a row over \d+s", refused.reason), refused.reason
    assert "integer out of range" in refused.reason and "\n" not in refused.reason
    assert client.creates >= REPEATED_5XX
    _given_back(ledger, "rejected")


def test_a_5xx_for_a_few_seconds_is_an_outage_not_a_refusal():
    """A Prefect server whose database restarts answers 500 to every request for a few
    seconds: however often it is asked meanwhile, that is waited out."""
    failures: dict = {}
    for _ in range(3 * REPEATED_5XX):
        with pytest.raises(DependencyDown), limits._prefect_call("taking slots", failures=failures):
            raise _http_error(500, "Internal Server Error")
    with limits._prefect_call("taking slots", failures=failures):
        pass  # answered at last: the count starts again
    assert failures == {}


def test_a_4xx_fails_the_request_at_once(ledger, prices):
    client = _FailingClient(_http_error(422, "limit: value is not a valid integer"))
    refused = _admit(ledger, prices, client, max_wait="1h")
    assert refused.state_name == "PrefectRefused" and "422" in refused.reason
    assert "value is not a valid integer" in refused.reason
    assert client.creates == 1
    _given_back(ledger, "rejected")


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (httpx.ConnectError("connection refused"), "the Prefect API is unreachable"),
        (_http_error(429, "slow down"), "the Prefect API answered 429"),
    ],
    ids=["unreachable", "too-many-requests"],
)
def test_an_outage_is_retried_only_until_the_max_wait_runs_out(ledger, prices, error, said):
    client = _FailingClient(error)
    refused = _admit(ledger, prices, client, max_wait="1s")
    assert refused.state_name == "AdmissionTimeout"
    assert refused.reason.startswith(f"max wait 1s ran out: {said}"), refused.reason
    assert client.creates >= 2  # an outage is retried, unlike a refusal
    _given_back(ledger, "timed_out")


def test_a_cap_change_shows_in_prefect_at_once_without_importing_prefect(prefect_api, tmp_path):
    """`budget set --hourly-cap` resizes the scope's Prefect limit itself (one plain HTTP call):
    the Concurrency page does not show the old cap until the scope's next admission."""
    import json
    import os
    import subprocess
    import sys

    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.limits import limit_name

    limits = RateLimits()
    limits.ensure([("capchg", 300)])  # as the scope's first admission left it
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    probe = (
        "import json, sys; from prefect_gpu_budget.cli import main; sys.argv = "
        "['prefect-gpu-budget', 'budget', 'set', 'capchg', '--hourly-cap', '1.5']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(json.dumps('prefect' in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False, "budget set imported Prefect"
    assert "warning" not in done.stderr, done.stderr
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(limit_name("capchg")).limit == 150
    limits.close()

    down = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_gpu_budget.cli",
            "budget",
            "set",
            "capchg",
            "--hourly-cap",
            "2",
        ],
        env={**env, "PREFECT_API_URL": "http://127.0.0.1:9/api"},
        capture_output=True,
        text=True,
    )
    assert down.returncode == 0  # the ledger holds the cap; Prefect catches up at admission
    assert "keeps its old cap until the next admission in capchg" in down.stderr


@pytest.mark.usefixtures("prefect_api")
def test_a_lease_over_a_limit_prefect_does_not_have_is_refused_and_given_back():
    """Prefect answers a request for slots of a limit it does not have with a lease, and takes
    no slot: acquire gives that lease back and says which limit is missing; once ensure has
    made it (again, after a delete), the slots are taken."""
    from prefect.client.orchestration import get_client

    limits = RateLimits()
    try:
        with pytest.raises(LimitsMissing, match="no concurrency limit gpu-budget:absent"):
            limits.acquire(["absent"], 7)
        assert isinstance(LimitsMissing("x"), DependencyDown)  # retried, not a refusal
        limits.ensure([("absent", 100)])
        lease = limits.acquire(["absent"], 7)
        assert lease is not None and limits.active_slots("absent") == 7
        limits.release(lease)
        with get_client(sync_client=True) as client:  # deleted while this process remembers it
            client.delete_global_concurrency_limit_by_name(limit_name("absent"))
        with pytest.raises(LimitsMissing):
            limits.acquire(["absent"], 7)
        limits.ensure([("absent", 100)])  # made again: the process forgot it had made it
        assert limits.acquire(["absent"], 7) is not None and limits.active_slots("absent") == 7
    finally:
        limits.close()


class _Locked(httpx.BaseTransport):
    """Below a Prefect client's transport: answers 503 to the first `times` requests for slots,
    as Prefect's server does while another writer holds its SQLite database; every other
    request reaches the real server."""

    def __init__(self, inner, times: int) -> None:
        self.inner, self.times, self.refused = inner, times, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/increment-with-lease") and self.refused < self.times:
            self.refused += 1
            return httpx.Response(503, json={"exception_message": "Service Unavailable"})
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class _Backoff:
    """Prefect's client's clock, its back-off sleeps written down and skipped."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def _locked_limits(times: int):
    from prefect.client.orchestration import get_client

    client = get_client(sync_client=True)
    client.__enter__()
    locked = client._client._transport = _Locked(client._client._transport, times)
    return client, locked, RateLimits(client)


@pytest.mark.usefixtures("prefect_api")
def test_slots_refused_for_a_moment_by_a_locked_database_are_asked_again_at_once(monkeypatch):
    """A 503 to a request for slots is asked again within a fraction of a second: Prefect's
    client would wait its back-off (2 s and more) first, and on the embedded SQLite server every
    admission of a busy sweep waited that long for its slots (the demo's trials 1.7-2.8 s)."""
    import prefect.client.base

    backoff = _Backoff()
    monkeypatch.setattr(prefect.client.base, "time", backoff)
    client, locked, limits = _locked_limits(times=len(PROMPT_RETRY_S))
    try:
        limits.ensure([("locked", 100)])
        lease = limits.acquire(["locked"], 7)
        assert lease is not None and limits.active_slots("locked") == 7
        assert locked.refused == len(PROMPT_RETRY_S)
        assert backoff.slept == []  # Prefect's client never saw a 503
        limits.release(lease)
        assert limits.active_slots("locked") == 0
    finally:
        client.__exit__(None, None, None)


@pytest.mark.usefixtures("prefect_api")
def test_a_503_that_goes_on_is_prefects_clients_to_wait_out_as_before(monkeypatch):
    """Past the prompt asks, the 503 reaches Prefect's client, which waits its back-off and asks
    again as it always did, and then the gate counts an outage."""
    import prefect.client.base
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    backoff = _Backoff()
    monkeypatch.setattr(prefect.client.base, "time", backoff)
    client, locked, limits = _locked_limits(times=1000)
    try:
        limits.ensure([("stuck", 100)])
        with (
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 1}),
            pytest.raises(DependencyDown, match="answered 503 while taking"),
        ):
            limits.acquire(["stuck"], 7)
        assert len(backoff.slept) == 2 and min(backoff.slept) >= 1  # its own back-off
        assert locked.refused == 2 * (len(PROMPT_RETRY_S) + 1)  # each of its asks, promptly
        assert limits.active_slots("stuck") == 0
    finally:
        client.__exit__(None, None, None)


def test_a_cap_change_asks_a_busy_prefect_again():
    """A Prefect server on SQLite answers 503 while another writer holds its database: the
    resize over plain HTTP asks again after a moment, as the gate's client does, and does not
    leave the old cap showing for a lock held a few milliseconds."""
    import http.server
    import threading

    from prefect_gpu_budget.admission.limits import resize_over_http

    asked: list[str] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            asked.append(self.rfile.read(int(self.headers["Content-Length"])).decode())
            self.send_response(503 if len(asked) <= 2 or len(asked) > 3 else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{server.server_address[1]}/api"
        assert resize_over_http("capchg", 150, api) == ""
        assert asked == ['{"limit": 150}'] * 3
        asked.append("")  # past the third ask, every answer is 503: a server that stays busy
        said = resize_over_http("capchg", 150, api)
        assert said == "the Prefect API answered 503 Service Unavailable", said
    finally:
        server.shutdown()
