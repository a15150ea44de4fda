"""What an agent measures: its `Recorder` (one JSON line of samples and counts per sampling
interval), and the ledger and Prefect limits it times into it."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.rules.policy import Decision


class Recorder:
    """Samples and counters of one agent, written as one JSON line per sampling interval.

    Only the current interval's samples are held, so the recorder's own memory stays flat.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "w", buffering=1)  # noqa: SIM115 (closed in close())
        self._lock = threading.Lock()
        self._latency: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []

    def latency(self, stream: str, seconds: float) -> None:
        with self._lock:
            self._latency[stream].append((round(time.time(), 3), round(seconds * 1000, 3)))

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def error(self, exc: BaseException) -> None:
        with self._lock:
            self.counts["errors"] += 1
            if len(self.errors) < 5:
                self.errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")

    def flush(
        self, sample: dict[str, Any], final: bool = False, unreleased: list[str] | None = None
    ) -> None:
        with self._lock:
            latency, self._latency = self._latency, defaultdict(list)
            line = {**sample, "latency": latency, "counts": dict(self.counts), "final": final}
            if final:
                line["errors"] = self.errors
                line["unreleased"] = unreleased or []
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


class TimedLedger(Ledger):
    """The ledger, timing its queue's decisions (recording the request, and re-deciding a
    waiter) and when a waiting job last learned it was admitted."""

    recorder: Recorder
    admitted_at = 0.0
    """perf_counter() when the last call that told a waiting job of its admission began: its
    own `try_admit`, or its watcher's `decided` read of what another transaction decided."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        queue = self.queue
        ask, try_admit, decided = queue.ask, queue.try_admit, queue.decided

        def timed_ask(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            out = ask(*args, **kwargs)
            self.recorder.latency("decide", time.perf_counter() - began)
            return out

        def timed_try_admit(*args: Any, **kwargs: Any) -> Decision:
            began = time.perf_counter()
            out = try_admit(*args, **kwargs)
            self.recorder.latency("decide", time.perf_counter() - began)
            if out.verdict == "admit":
                self.admitted_at = began
            return out

        def timed_decided(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            out = decided(*args, **kwargs)
            if any(decision.verdict == "admit" for decision, _ in out.values()):
                self.admitted_at = began
            return out

        queue.ask, queue.try_admit, queue.decided = (  # type: ignore[method-assign]
            timed_ask,
            timed_try_admit,
            timed_decided,
        )


class TimedLimits(RateLimits):
    """The Prefect limits, timing each acquisition (granted or refused) and keeping the leases
    granted but not yet released, with the thread that took each: a slot left taken at the end
    is then either a lease the gate never released (named here) or one it never saw."""

    recorder: Recorder

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, str] = {}

    def acquire(self, *args: Any, **kwargs: Any) -> str | None:
        began = time.perf_counter()
        out = super().acquire(*args, **kwargs)
        self.recorder.latency("acquire", time.perf_counter() - began)
        if out is not None:
            self.held[out] = f"{threading.current_thread().name} at {time.time():.3f}"
        return out

    def release(self, lease_id: str) -> None:
        super().release(lease_id)
        self.held.pop(lease_id, None)
