"""The cancellation-safe hand-off: a call run in a thread of its own for a caller that only
waits for it, so that an exception a signal raises in the caller (Ctrl-C, a task's time-out, or
one another thread injects) lands in that wait, never inside code that holds a lock (SQLAlchemy's
pool, the HTTP client), where it would leave the lock held and hang the process.

The gate admits and settles through it, and the launchers record a job's start through it:
it sits below both, and each passes the patience its call deserves.
"""

from __future__ import annotations

import _thread
import contextvars
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Done:
    """Set once by a worker thread, awaited by others. Unlike `threading.Event` (and
    `Thread.join`), a signal's exception landing in a waiter at any bytecode cannot leave it
    locked or lying: the flag is read first and the wait is one C call on a plain lock."""

    def __init__(self) -> None:
        self.flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self.flag = True
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        if self.flag:
            return True
        if self._lock.acquire(timeout=timeout):
            self._lock.release()
        return self.flag


class Handoff(Generic[T]):
    """A call run in a thread of its own (with the caller's context variables) for a caller
    that only waits for it, so that an exception a signal raises in the caller (or another
    thread injects) lands in that wait and nowhere else.

    `claim` settles a race once: the first to claim (the caller, cancelled; or the thread, done)
    decides who cleans up. List appends are atomic, so no lock is taken that a signal could
    leave held."""

    def __init__(self) -> None:
        self.begun, self.done = Done(), Done()
        self.claims: list[str] = []
        self.on_cancel: list[Callable[[], None]] = []
        """Called in the caller's thread once it is cancelled (to wake the thread's waits)."""
        self.result: T | None = None
        self.error: BaseException | None = None

    def start(self, call: Callable[[], T]) -> None:
        def run() -> None:
            self.begun.set()
            try:
                self.result = call()
            except BaseException as exc:  # raised again in the caller's thread
                self.error = exc
            finally:
                self.done.set()

        _thread.start_new_thread(contextvars.copy_context().run, (run,))

    def run(self, call: Callable[[], T], patience: float) -> T:
        """`call()` in the thread, awaited. On an exception in the caller (a signal's), claim
        "cancelled", wait up to `patience` s for the thread to end, then let it go on."""
        try:
            self.start(call)
            while not self.done.wait(1.0):
                pass
            if self.error is not None:
                raise self.error
            return self.result  # type: ignore[return-value]
        except BaseException:
            self.claim("cancelled")
            for wake in list(self.on_cancel):
                wake()
            if self.begun.wait(1.0):  # (a thread that never began does nothing)
                self.done.wait(patience)
            raise

    def claim(self, who: str) -> bool:
        self.claims.append(who)
        return self.claims[0] == who

    @property
    def cancelled(self) -> bool:
        return bool(self.claims) and self.claims[0] == "cancelled"


def off_thread(call: Callable[[], T], patience: float) -> T:
    """`call()` in a thread of its own, run to its end even if the caller is cancelled (then
    awaited up to `patience` s more)."""
    return Handoff().run(call, patience)
