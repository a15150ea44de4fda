"""Stand-ins for Prefect's concurrency limits, the gate's side of the conversation only (any
object with `Limits`' methods will do: admission/limits.py)."""

from __future__ import annotations

import threading


class SlowLimits:
    """Prefect limits answering a request for slots only after `delay` seconds, or as soon as
    the test sets `go` (a Prefect API coming back from an outage): the gate's side of the
    conversation, nothing else. `asked` is set once a request for slots is outstanding."""

    def __init__(self, delay: float) -> None:
        self.delay, self.taken, self.released = delay, [], []
        self.asked, self.go = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def ensure(self, caps) -> None:
        pass

    def acquire(self, scopes: list[str], slots: int) -> str:
        self.asked.set()
        self.go.wait(self.delay)
        with self._lock:  # asks from two threads (an early one beside an admission's own)
            self.taken.append(f"lease-{len(self.taken) + 1}")
            return self.taken[-1]

    def renew(self, lease_id: str) -> bool:
        return True

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)
