"""Who calls the agents' door: a `Bearer` token turned into the caller's (session, grant)
(`CallerCheck.caller`), with the limits on bad tokens and on calls; and `Refused`, what the door
answers a call it turns down, whichever transport it came through."""

from __future__ import annotations

from dataclasses import dataclass

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.agents.throttle import LocalStore, RedisStore, address_key
from prefect_gpu_budget.units import BudgetInputError

AUTH_FAILURES = (10, 60.0)
"""At most this many bad tokens per client address and token prefix per window (s); then 429
for that pair until it passes: one client's storm of bad (or stale) tokens locks out itself,
not the other agents behind the same address (a shared NAT or proxy)."""
AUTH_FAILURES_PER_ADDRESS = (200, 60.0)
"""At most this many bad tokens per client address (IPv6: per /64), whatever their prefixes,
per window (s); then 429 for every bad token from it until it passes (valid ones still pass)."""
LOOKUPS_PAST_THE_CAP = (20, 1.0)
"""Past AUTH_FAILURES_PER_ADDRESS, at most this many tokens from that address are looked up per
window (s); the rest get 429 unread: an enumerator's storm costs the ledger 20 reads a second
at most, while a valid agent behind the same address gets through between them."""
TOKEN_PREFIX = 12
"""How much of a presented token tells one client's failures from another's: `gpub_` and 7
random characters (a valid token's prefix is no secret worth having: 32 random bytes follow)."""
CALLS = (120, 60.0)
"""At most this many calls per grant per window (s)."""


class Refused(Exception):
    """A call the door turns down: an HTTP-like `status` (401, 404, 409, 422, 429, 503), a
    one-line `detail`, and the `headers` a transport should send with it."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.headers: dict[str, str] = dict(headers or {})


@dataclass(frozen=True)
class Caller:
    """Who calls: the agent's session and its grant's id (never its token)."""

    session: str
    grant: str


class CallerCheck:
    """Tokens to callers for one ledger, with the limits counted in `counts` (one process's,
    or a Redis shared with the other gateways)."""

    def __init__(self, ledger: Ledger, counts: LocalStore | RedisStore) -> None:
        self.ledger = ledger
        self.failures = counts.window("bad-tokens", *AUTH_FAILURES)
        self.calls = counts.window("calls", *CALLS)
        self.address_failures = counts.window("bad-tokens-per-address", *AUTH_FAILURES_PER_ADDRESS)
        self.lookups_past_the_cap = counts.window("lookups-past-the-cap", *LOOKUPS_PAST_THE_CAP)

    def caller(self, authorization: str | None, address: str) -> Caller:
        """The caller of a `Bearer` token from the client at `address` (the transport's word
        for it: the socket's peer, or what a trusted proxy says); 401 for none or a bad one,
        429 past the limits, with `Retry-After`.

        Bad tokens are counted per (address, the token's first TOKEN_PREFIX characters) and
        per address. A client that keeps presenting a bad token is refused (429) without its
        token being looked up, while other agents behind the same address are not. Past
        AUTH_FAILURES_PER_ADDRESS every bad token from that address is a 429 rather than a 401,
        but a valid one is still served: an enumerator behind a shared NAT or proxy slows
        itself, and does not lock the other agents there out. It stays cheap: past the cap, at
        most LOOKUPS_PAST_THE_CAP tokens a second from that address are looked up, the rest
        refused unread (a token is 32 random bytes: the cap bounds the storm's cost, guessing
        is hopeless anyway)."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        where = address_key(address)
        pair = (where, token[:TOKEN_PREFIX])
        past_the_cap = self._refuse_storms(where, pair)
        session, grant = self._look_up(scheme, token, where, pair, past_the_cap)
        if self.calls.hit(grant):
            raise Refused(
                429,
                "too many calls for this session; wait",
                {"Retry-After": str(self.calls.retry_after(grant))},
            )
        return Caller(session, grant)

    def _refuse_storms(self, where: str, pair: tuple[str, str]) -> bool:
        """429 for a client past its bad tokens, or for an address past the cap once its
        lookups past the cap are spent; else whether the address is past the cap."""
        if self.failures.full(pair):
            raise Refused(
                429,
                "too many bad tokens like this one from this address; wait",
                {"Retry-After": str(self.failures.retry_after(pair))},
            )
        past_the_cap = self.address_failures.full(where)
        if past_the_cap and self.lookups_past_the_cap.hit(where):
            raise Refused(
                429,
                "too many bad tokens from this address; wait",
                {"Retry-After": str(self.address_failures.retry_after(where))},
            )
        return past_the_cap

    def _look_up(
        self, scheme: str, token: str, where: str, pair: tuple[str, str], past_the_cap: bool
    ) -> tuple[str, str]:
        """The token's (session, grant); a bad token is counted and refused, 401 (429 past
        the cap)."""
        try:
            if scheme.lower() != "bearer" or not token:
                raise BudgetInputError("authorization", "a bearer token is required")
            session, grant = self.ledger.grants.agent_grant(token)
        except BudgetInputError:
            if past_the_cap:
                raise Refused(
                    429,
                    "too many bad tokens from this address; wait",
                    {"Retry-After": str(self.address_failures.retry_after(where))},
                ) from None
            self.address_failures.hit(where)
            self.failures.hit(pair)
            raise Refused(401, "unknown or revoked token", {"WWW-Authenticate": "Bearer"}) from None
        return session, grant
