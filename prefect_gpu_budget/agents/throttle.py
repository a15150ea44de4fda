"""What the agents' door counts callers with, knowing nothing of agents: events per key in a
sliding window (`Window`: bad tokens, calls), slots held per key and in all (`Slots`: long
polls), and the key of a client address (`address_key`)."""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import deque
from collections.abc import Hashable


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
