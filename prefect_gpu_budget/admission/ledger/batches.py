"""Calls that arrive together run together: `Batcher`, a group commit for one kind of call.

The first thread to call runs the work for itself and hands the lead on; threads that call
while a run is under way wait, and the next run takes all of them at once (up to `most`). Each
caller gets its own result, or its own exception: when a run raises, its callers are run again
one by one, so one bad call fails only itself.

The ledger records a burst of requests this way: a thousand threads asking at once cost a few
transactions, not a thousand, each under the org's lock in turn (`Ledger.queue.ask`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")


class _Call(Generic[A, R]):
    __slots__ = ("arg", "result", "error", "done", "lead", "woken")

    def __init__(self, arg: A) -> None:
        self.arg = arg
        self.result: R | None = None
        self.error: BaseException | None = None
        self.done = False
        self.lead = False
        self.woken = threading.Event()


class Batcher(Generic[A, R]):
    """Runs `run(args)` (one result per argument, in order) for the calls waiting together.

    One run at a time: a caller either runs the next batch (the lead is handed to the first
    caller waiting when a run ends) or waits for its result."""

    def __init__(self, run: Callable[[Sequence[A]], Sequence[R]], most: int = 256) -> None:
        self._run = run
        self._most = most
        self._mutex = threading.Lock()
        self._waiting: list[_Call[A, R]] = []
        self._running = False

    def call(self, arg: A) -> R:
        me: _Call[A, R] = _Call(arg)
        with self._mutex:
            self._waiting.append(me)
            me.lead = not self._running
            self._running = True
        while not me.lead and not me.done:
            me.woken.wait()
            me.woken.clear()
        if not me.done:  # leading: my call is first in line
            self._run_next(me)
        if me.error is not None:
            raise me.error
        return me.result  # type: ignore[return-value]

    def _run_next(self, leader: _Call[A, R]) -> None:
        with self._mutex:
            batch, self._waiting = self._waiting[: self._most], self._waiting[self._most :]
        try:
            self._settle(batch)
        except BaseException:  # the leader interrupted: the others wait for the next run
            with self._mutex:
                self._waiting[:0] = [c for c in batch if not c.done and c is not leader]
            raise
        finally:
            with self._mutex:
                if self._waiting:
                    self._waiting[0].lead = True
                    self._waiting[0].woken.set()
                else:
                    self._running = False
            for call in batch:
                if call.done:
                    call.woken.set()

    def _settle(self, batch: list[_Call[A, R]]) -> None:
        try:
            results = self._run([c.arg for c in batch])
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error, batch[0].done = exc, True
                return
            for call in batch:  # one by one: each gets its own result or error
                self._settle([call])
            return
        for call, result in zip(batch, results, strict=True):
            call.result, call.done = result, True
