"""The Prefect edge of the hourly cap: one global concurrency limit per capped scope.

A scope's limit is its cap in cents per hour; an admitted job occupies its rate in cents in every
limit on its path, taken in one atomic request under a lease that the job's heartbeat renews.
The ledger decides first (in priority order, with reasons); the limits then show the running
rate in the Prefect UI and guard against anything that takes slots outside the ledger. A holder
that dies stops renewing, and a real Prefect server's lease repossessor returns its slots.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol
from uuid import UUID

from prefect_gpu_budget.admission.rules.timing import LEASE_S

PREFIX = "gpu-budget"


REPEATED_5XX = 3
"""The same request answered with a 5xx this many times in a row (each after the Prefect
client's own retries), over at least `REPEATED_5XX_SPAN_S`, is refused, not an outage: a server
that cannot hold a value answers 503 to it for ever."""
REPEATED_5XX_SPAN_S = 60.0
"""How long the same 5xx must go on before it counts as a refusal: a Prefect server whose own
database restarts answers 500 to everything for a few seconds, and its jobs must wait that out."""


BUSY = (408, 429)
"""4xx answers that mean "not now" (a timeout, too many requests): an outage, not a refusal."""

PROMPT_RETRY_S = (0.02, 0.05, 0.1, 0.2, 0.4)
"""Pauses before a request Prefect's server answered 503 is sent again by this process's client
(`PromptRetries`), before Prefect's client sees the answer. A Prefect server on SQLite (the
embedded default) answers 503 whenever another writer holds its database for a moment (task
runs, events, logs), and Prefect's client waits its back-off, 2 s and more, before it asks
again: each admission waited that long for its slots. After the last pause the answer is
Prefect's client's to handle, as before (a real outage)."""


class DependencyDown(RuntimeError):
    """The Prefect API did not answer (down, restarting, or overloaded)."""


class LimitsMissing(DependencyDown):
    """Prefect granted a lease over fewer limits than were named: one does not exist (not yet
    made, or deleted since this process made it). Prefect takes no slots of a limit it does
    not have, yet answers as if it did, so the job would run unmetered there. The lease has
    gone back; `ensure` the limits, then ask again."""


class PrefectRefused(RuntimeError):
    """The Prefect API refused a request (a 4xx, or the same 5xx again and again): retrying it
    will not help, so the request fails with this one-line reason."""


def _detail(exc: Exception) -> str:
    """The server's one-line reason for an HTTP error, cut short."""
    response = exc.response  # type: ignore[attr-defined]
    try:
        detail = response.json().get("detail", "")
    except Exception:  # not JSON
        detail = response.text
    text = " ".join(str(detail).split())
    return text if len(text) <= 160 else text[:157] + "..."


@contextlib.contextmanager
def _prefect_call(
    what: str,
    *,
    passes: tuple[int, ...] = (),
    failures: dict[str, tuple[int, float]] | None = None,
    key: str = "",
) -> Iterator[None]:
    """Turn transport failures and 5xx answers into DependencyDown, and 4xx answers (but the
    statuses in `passes`, which the caller handles) into PrefectRefused, with a one-line reason.
    With `failures` ((count, first time) by request), the same request (`key`) answered 5xx
    `REPEATED_5XX` times in a row over `REPEATED_5XX_SPAN_S` is PrefectRefused too.

    Prefect's client has already retried by then (it retries a dropped connection with back-off).
    """
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        yield
    except httpx.TransportError as exc:
        raise DependencyDown(
            f"the Prefect API is unreachable while {what} ({type(exc).__name__})"
        ) from None
    except PrefectHTTPStatusError as exc:
        status = exc.response.status_code
        if status in passes:
            raise
        if status < 500 and status not in BUSY:
            raise PrefectRefused(
                f"the Prefect API refused {what} ({status}: {_detail(exc)})"
            ) from None
        if failures is not None and status >= 500:
            count, since = failures.get(key, (0, time.monotonic()))
            failures[key] = (count + 1, since)
            span = time.monotonic() - since
            if count + 1 >= REPEATED_5XX and span >= REPEATED_5XX_SPAN_S:
                del failures[key]
                raise PrefectRefused(
                    f"the Prefect API answered {status} {count + 1} times in a row over "
                    f"{span:.0f}s while {what}: not an outage, the request itself fails "
                    f"({_detail(exc)})"
                ) from None
        raise DependencyDown(f"the Prefect API answered {status} while {what}") from None
    if failures is not None:
        failures.pop(key, None)


def resize_over_http(scope: str, cents: int, api_url: str, auth: str | None = None) -> str:
    """Set the Prefect limit of `scope` to `cents` at once, with one PATCH over plain HTTP (a
    `budget set` must not import Prefect). '' when done, or when the limit does not exist yet
    (the scope's next admission creates it at the new cap); else why not, in one line."""
    import base64
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    name = urllib.parse.quote(limit_name(scope), safe="")
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(
        f"{api_url.rstrip('/')}/v2/concurrency_limits/{name}",
        data=json.dumps({"limit": max(1, cents)}).encode(),
        headers=headers,
        method="PATCH",
    )
    for pause in (*PROMPT_RETRY_S, None):  # a 503 (a server on SQLite, busy) asked again
        try:
            with urllib.request.urlopen(request, timeout=5):
                return ""
        except urllib.error.HTTPError as exc:
            if exc.code == 503 and pause is not None:
                time.sleep(pause)
                continue
            return "" if exc.code == 404 else f"the Prefect API answered {exc.code} {exc.reason}"
        except (OSError, ValueError) as exc:
            return f"the Prefect API did not answer ({getattr(exc, 'reason', exc)})"
    return ""  # not reached: the last pause is None


def limit_name(scope: str) -> str:
    """`acme/vision` -> `gpu-budget:acme:vision` (Prefect forbids `/`; scopes never hold `:`)."""
    return f"{PREFIX}:{scope.replace('/', ':')}"


class Limits(Protocol):
    """What the gate asks of the Prefect concurrency limits: `RateLimits`, or a stand-in in
    tests (any object with these methods)."""

    def ensure(self, caps: Iterable[tuple[str, int]]) -> None: ...

    def acquire(self, scopes: list[str], slots: int) -> str | None: ...

    def renew(self, lease_id: str) -> bool: ...

    def release(self, lease_id: str) -> None: ...


class PromptRetries:
    """An httpx transport around the one a Prefect client was built with: a 503 is asked again
    after each of `PROMPT_RETRY_S` before the client sees it. Below the client, because the
    client sleeps its back-off even when told to retry nothing (PREFECT_CLIENT_MAX_RETRIES 0
    still waits once before it returns the 503)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def handle_request(self, request: Any) -> Any:
        for pause in PROMPT_RETRY_S:
            response = self.inner.handle_request(request)
            if response.status_code != 503:
                return response
            response.read()
            response.close()
            time.sleep(pause)
        return self.inner.handle_request(request)

    def __enter__(self) -> PromptRetries:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def close(self) -> None:
        self.inner.close()


def prompt(client: Any) -> Any:
    """`client` (Prefect's sync client), its httpx transport (`_transport`: httpx names no public
    way to wrap the transport it built from Prefect's TLS and pool settings) wrapped in
    `PromptRetries` once; a client of another shape (a stand-in in tests) as it is."""
    http = getattr(client, "_client", None)
    inner = getattr(http, "_transport", None)
    if inner is not None and not isinstance(inner, PromptRetries):
        http._transport = PromptRetries(inner)  # type: ignore[union-attr]
    return client


class RateLimits:
    """Prefect global concurrency limits for hourly caps, through the raw client API (~9 ms)."""

    def __init__(self, client: Any | None = None) -> None:
        self._given = prompt(client) if client is not None else None
        self._owned: Any | None = None
        self._applied: dict[str, int] = {}
        self._failures: dict[str, tuple[int, float]] = {}
        """Per request, how many 5xx answers in a row it got."""
        self._lock = threading.Lock()
        self._opening = threading.Lock()

    @property
    def _client(self) -> Any:
        """The client handed in, else Prefect's own, opened on first use: a reconcile with
        nothing to release never imports Prefect."""
        if self._given is not None:
            return self._given
        with self._opening:
            if self._owned is None:
                from prefect.client.orchestration import get_client

                client = get_client(sync_client=True)
                client.__enter__()
                self._owned = prompt(client)
            return self._owned

    def close(self) -> None:
        if self._owned is not None:
            self._owned.__exit__(None, None, None)
            self._owned = None

    def ensure(self, caps: Iterable[tuple[str, int]]) -> None:
        """Create or resize the limit of each (scope, cap in cents) (cached per process)."""
        from prefect.client.schemas.actions import (
            GlobalConcurrencyLimitCreate,
            GlobalConcurrencyLimitUpdate,
        )
        from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

        for scope, cents in caps:
            name, cap = limit_name(scope), max(1, cents)
            if self._applied.get(name) == cap:
                continue
            with (
                self._lock,
                _prefect_call(
                    f"setting concurrency limit {name} to {cap}",
                    failures=self._failures,
                    key=f"ensure {name} {cap}",
                ),
            ):
                if self._applied.get(name) == cap:
                    continue
                try:
                    current = self._client.read_global_concurrency_limit_by_name(name)
                except ObjectNotFound:
                    try:
                        self._client.create_global_concurrency_limit(
                            GlobalConcurrencyLimitCreate(name=name, limit=cap)
                        )
                    except ObjectAlreadyExists:  # created by another process just now
                        current = self._client.read_global_concurrency_limit_by_name(name)
                    else:
                        current = None
                if current is not None and current.limit != cap:
                    self._client.update_global_concurrency_limit(
                        name, GlobalConcurrencyLimitUpdate(limit=cap)
                    )
                self._applied[name] = cap

    def acquire(self, scopes: list[str], slots: int) -> str | None:
        """Take `slots` in every named limit at once; None if any is full (no waiting).
        LimitsMissing if Prefect has no limit of one of the scopes (`ensure` makes them)."""
        from prefect.exceptions import PrefectHTTPStatusError

        try:
            with _prefect_call(
                "taking concurrency slots",
                passes=(423,),
                failures=self._failures,
                key=f"acquire {','.join(sorted(scopes))} {slots}",
            ):
                response = self._client.increment_concurrency_slots_with_lease(
                    names=[limit_name(s) for s in scopes],
                    slots=slots,
                    mode="concurrency",
                    lease_duration=LEASE_S,
                )
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code == 423:
                return None
            raise
        granted = response.json()
        lease = str(granted["lease_id"])
        missing = {limit_name(s) for s in scopes} - {
            str(limit["name"]) for limit in granted.get("limits", ())
        }
        if missing:
            with contextlib.suppress(Exception):  # not given back: it lapses, LEASE_S
                self.release(lease)
            for name in missing:
                self._applied.pop(name, None)  # made again by the next ensure
            raise LimitsMissing(
                f"Prefect has no concurrency limit {', '.join(sorted(missing))}: its lease "
                "went back, and the limit is made again before the slots are asked again"
            )
        return lease

    def renew(self, lease_id: str) -> bool:
        """Extend the lease; False if it is gone (expired and its slots repossessed)."""
        from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

        try:
            with _prefect_call("renewing a lease", passes=(404, 410)):
                self._client.renew_concurrency_lease(UUID(lease_id), lease_duration=LEASE_S)
        except ObjectNotFound:
            return False
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code in (404, 410):
                return False
            raise
        return True

    def release(self, lease_id: str) -> None:
        from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

        # Already expired and repossessed: nothing left to give back.
        with _prefect_call("releasing slots"):
            try:
                self._client.release_concurrency_slots_with_lease(UUID(lease_id))
            except ObjectNotFound:
                pass
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code >= 500:
                    raise

    def active_slots(self, scope: str) -> int | None:
        """Slots in use in a scope's limit (None if it has none), for status and checks."""
        from prefect.exceptions import ObjectNotFound

        try:
            return int(
                self._client.read_global_concurrency_limit_by_name(limit_name(scope)).active_slots
            )
        except ObjectNotFound:
            return None
