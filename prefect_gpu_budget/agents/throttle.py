"""What the agents' door counts callers with, knowing nothing of agents: events per key in a
sliding window (`Window`: bad tokens, calls), slots held per key and in all (`Slots`: long
polls), and the key of a client address (`address_key`).

One gateway counts in its own memory (`LocalStore`); gateways behind a load balancer count in
one Redis (`RedisStore`: `RedisWindow`, `RedisSlots`, same methods), so that the limits hold per
address and per grant whichever gateway answers. `store` picks one."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Hashable
from typing import Any

_log = logging.getLogger(__name__)


class Window:
    """Events per key in a sliding window: `hit` records one and says whether it is one too
    many; `full` only asks; `retry_after` says in how many seconds a full key has room again.
    Keys with nothing in the window are forgotten, and every key is swept once a window, so
    keys seen once (a storm of distinct bad tokens) do not pile up."""

    def __init__(self, most: int, per_s: float) -> None:
        self.most, self.per_s = most, per_s
        self._seen: dict[Hashable, deque[float]] = {}
        self._lock = threading.Lock()
        self._next_sweep = time.monotonic() + per_s

    def _live(self, key: Hashable, now: float) -> int:
        seen = self._seen.get(key)
        while seen and seen[0] <= now - self.per_s:
            seen.popleft()
        if not seen:
            self._seen.pop(key, None)
            return 0
        return len(seen)

    def _sweep(self, now: float) -> None:
        if now >= self._next_sweep:
            for key in list(self._seen):
                self._live(key, now)
            self._next_sweep = now + self.per_s

    def full(self, key: Hashable) -> bool:
        with self._lock:
            return self._live(key, time.monotonic()) >= self.most

    def hit(self, key: Hashable) -> bool:
        with self._lock:
            now = time.monotonic()
            self._sweep(now)
            count = self._live(key, now) + 1
            self._seen.setdefault(key, deque()).append(now)
            return count > self.most

    def retry_after(self, key: Hashable) -> int:
        """Whole seconds until `key` is below its limit again (at least 1)."""
        with self._lock:
            now = time.monotonic()
            seen = self._seen.get(key)
            if not seen or self._live(key, now) < self.most:
                return 1
            frees = seen[len(seen) - self.most] + self.per_s  # the event whose expiry makes room
            return max(1, math.ceil(frees - now))


class Slots:
    """At most `per_key` held per key and `total` in all; `take` says whether one was free."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key, self.total = per_key, total
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> bool:
        with self._lock:
            if self._held.get(key, 0) >= self.per_key or sum(self._held.values()) >= self.total:
                return False
            self._held[key] = self._held.get(key, 0) + 1
            return True

    def give(self, key: Hashable) -> None:
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)


def address_key(address: str) -> str:
    """The key of a client address for the per-address limit: an IPv4 address (also one mapped
    into IPv6) as it is, an IPv6 one by its /64 (one host's usual share); anything else as given."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


# -- shared by every gateway: the same counts in Redis ---------------------------------------

NAMESPACE = "gpu-budget:throttle:"
"""What every throttle key in Redis starts with (a key: NAMESPACE, the throttle's name, and
the counted key: an address, a grant's id, or an address and a token's first characters)."""
DOWN_PAUSE_S = 1.0
"""After Redis failed to answer, how long every call fails closed without asking it again."""
RETRY_WHEN_DOWN_S = 5
"""The `Retry-After` of a refusal made because Redis did not answer."""
SLOT_LEASE_S = 15.0
"""How long a slot a gateway holds outlives that gateway: a holder's entry expires unless its
gateway renews it (every third of this), so slots of a gateway that died come free again."""

_WINDOW = """
local key, mode = KEYS[1], ARGV[1]
local most, per = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - per)
local count = redis.call('ZCARD', key)
if mode == 'hit' then
  redis.call('ZADD', key, now, now .. ':' .. ARGV[4])
  redis.call('PEXPIRE', key, per)
  return count + 1
end
if mode == 'retry' then
  if count < most then return 0 end
  local frees = redis.call('ZRANGE', key, count - most, count - most, 'WITHSCORES')
  return tonumber(frees[2]) + per - now
end
return count
"""
"""One window's key, atomically: drop the events older than the window (times in ms, Redis's
clock: gateways' clocks may differ), then count (`full`), add one (`hit`: the count with it) or
say in how many ms the event whose expiry makes room leaves (`retry`)."""

_TAKE = """
local most, total, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= most or redis.call('ZCARD', KEYS[2]) >= total then
  return 0
end
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + lease, ARGV[4])
  redis.call('PEXPIRE', key, lease)
end
return 1
"""
"""Take a slot for holder ARGV[4] in the key's set (KEYS[1]) and the total's (KEYS[2]), each a
sorted set of holders by the time their lease ends; expired holders (a dead gateway's) go
first."""

_RENEW = """
local lease = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #KEYS, 2 do
  local holder = ARGV[(i + 1) / 2 + 1]
  for _, key in ipairs({KEYS[i], KEYS[i + 1]}) do
    if redis.call('ZADD', key, 'XX', 'CH', now + lease, holder) == 1 then
      redis.call('PEXPIRE', key, lease)
    end
  end
end
return 1
"""
"""Push the lease of each held slot (KEYS: its key's set and the total's, pair by pair; ARGV:
the lease, then the holders) to now + lease; one already expired is not brought back."""


def _key_text(key: Hashable) -> str:
    """A counted key as Redis names it: a string as it is, anything else as JSON (a tuple as a
    list), so that no two keys share a name."""
    if isinstance(key, str):
        return key
    return json.dumps(list(key) if isinstance(key, tuple) else key, separators=(",", ":"))


class RedisStore:
    """The throttles' state in one Redis, shared by every gateway that names it: `window` and
    `slots` make the shared twins of `Window` and `Slots`.

    Redis unreachable (or failing): every throttle fails closed. A window counts as full (each
    `hit` is one too many, `retry_after` is RETRY_WHEN_DOWN_S) and no slot is free; a `give`
    that cannot reach Redis is left to its lease. So while Redis is down the gateway answers
    429 with a `Retry-After` (and a long poll at once) rather than looking up tokens unbounded:
    a guesser who makes Redis fail, or waits for it to, gets no door without limits, and the
    clients already back off on a 429. For DOWN_PAUSE_S after a failure Redis is not asked at
    all, so an outage costs no timeouts per call; the first failure of an outage is logged."""

    def __init__(self, url: str, prefix: str = NAMESPACE, timeout_s: float = 2.0) -> None:
        import redis

        self.prefix = prefix
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._window = self.client.register_script(_WINDOW)
        self._take = self.client.register_script(_TAKE)
        self._renew = self.client.register_script(_RENEW)
        self._errors: tuple[type[Exception], ...] = (redis.RedisError,)
        self._down_until = 0.0
        self._lock = threading.Lock()

    def window(self, name: str, most: int, per_s: float) -> RedisWindow:
        return RedisWindow(self, name, most, per_s)

    def slots(self, name: str, per_key: int, total: int) -> RedisSlots:
        return RedisSlots(self, name, per_key, total)

    def run(self, script: Any, keys: list[str], args: list[Any], failed: Any) -> Any:
        """`script`'s answer, or `failed` when Redis does not give one (see the class)."""
        if time.monotonic() < self._down_until:
            return failed
        try:
            answer = script(keys=keys, args=args)
        except self._errors as exc:
            with self._lock:
                first, self._down_until = not self._down_until, time.monotonic() + DOWN_PAUSE_S
            if first:
                _log.warning(
                    "the gateways' shared throttle is unreachable (%s): failing closed", exc
                )
            return failed
        if self._down_until:
            with self._lock:
                self._down_until = 0.0
            _log.warning("the gateways' shared throttle answers again")
        return answer


class RedisWindow:
    """`Window` with its events in Redis: one sorted set per key (score and member: the event's
    time in ms by Redis's clock), trimmed and counted in one script, so gateways racing for the
    last event of a window cannot both pass; each key expires a window after its last event."""

    def __init__(self, store: RedisStore, name: str, most: int, per_s: float) -> None:
        self.store, self.most, self.per_s = store, most, per_s
        self._name = f"{store.prefix}{name}:"
        self._per_ms = max(1, math.ceil(per_s * 1000))

    def _ask(self, mode: str, key: Hashable, failed: int) -> int:
        args = [mode, self.most, self._per_ms, uuid.uuid4().hex[:12]]
        return int(self.store.run(self.store._window, [self._name + _key_text(key)], args, failed))

    def full(self, key: Hashable) -> bool:
        return self._ask("full", key, self.most) >= self.most

    def hit(self, key: Hashable) -> bool:
        return self._ask("hit", key, self.most + 1) > self.most

    def retry_after(self, key: Hashable) -> int:
        """Whole seconds until `key` is below its limit again (at least 1)."""
        ms = self._ask("retry", key, RETRY_WHEN_DOWN_S * 1000)
        return max(1, math.ceil(ms / 1000))


class RedisSlots:
    """`Slots` in Redis: a sorted set of holders per key and one for the total, each holder
    (a slot this gateway took) scored by when its lease ends. A thread renews this gateway's
    holders while they are held, so a gateway that dies frees its slots within SLOT_LEASE_S,
    and `take` drops expired holders before counting."""

    def __init__(
        self, store: RedisStore, name: str, per_key: int, total: int, lease_s: float = SLOT_LEASE_S
    ) -> None:
        self.store, self.per_key, self.total, self.lease_s = store, per_key, total, lease_s
        self._name = f"{store.prefix}{{{name}}}:"  # one hash slot: a script touches both sets
        self._all = self._name + "all"
        self._mine: dict[Hashable, list[str]] = {}
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None

    def _key(self, key: Hashable) -> str:
        return f"{self._name}key:{_key_text(key)}"

    def take(self, key: Hashable) -> bool:
        holder = uuid.uuid4().hex
        args = [self.per_key, self.total, max(1, math.ceil(self.lease_s * 1000)), holder]
        if not self.store.run(self.store._take, [self._key(key), self._all], args, 0):
            return False
        with self._lock:
            self._mine.setdefault(key, []).append(holder)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, daemon=True)
                self._renewer.start()
        return True

    def give(self, key: Hashable) -> None:
        with self._lock:
            mine = self._mine.get(key)
            if not mine:
                return
            holder = mine.pop()
            if not mine:
                del self._mine[key]
        with contextlib.suppress(*self.store._errors):  # else its lease ends it
            pipe = self.store.client.pipeline()
            pipe.zrem(self._key(key), holder).zrem(self._all, holder).execute()

    def _renew(self) -> None:
        """Renew this gateway's holders every third of a lease while it holds any."""
        while True:
            time.sleep(self.lease_s / 3)
            with self._lock:
                held = [(key, h) for key, mine in self._mine.items() for h in mine]
                if not held:
                    self._renewer = None
                    return
            keys = [name for key, _ in held for name in (self._key(key), self._all)]
            lease = max(1, math.ceil(self.lease_s * 1000))
            self.store.run(self.store._renew, keys, [lease, *(h for _, h in held)], None)


class LocalStore:
    """The throttles of one process (`Window`, `Slots`): the default, for one gateway."""

    def window(self, name: str, most: int, per_s: float) -> Window:
        return Window(most, per_s)

    def slots(self, name: str, per_key: int, total: int) -> Slots:
        return Slots(per_key, total)


def store(redis_url: str | None) -> LocalStore | RedisStore:
    """Where the throttles count: in Redis at `redis_url`, shared by every gateway that names
    it, or, given none, in this process alone."""
    return RedisStore(redis_url) if redis_url else LocalStore()
