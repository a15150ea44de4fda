"""One agent process of `benchmarks/burst.py`: it imports only the package (from the tree its
PYTHONPATH names), so the same agent runs against an earlier checkout too (one whose ledger is
one object rather than stores: `getattr(ledger, "queue", ledger)`).

Usage (by burst.py): python benchmarks/burst_agent.py URL THREADS
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import prefect_gpu_budget

ORG, TEAM = "burst", "burst/team"
RATE_CENTS = 360


def main(url: str, threads: int) -> None:
    """One agent process: says `ready`, reads the start instant from stdin, then `threads`
    threads ask at that instant; prints its counts as JSON."""
    from sqlalchemy import event

    from prefect_gpu_budget.admission.ledger import Ledger, NewJob
    from prefect_gpu_budget.identity import holder_id

    ledger = Ledger(url, create=False)
    ended = [0]
    event.listen(
        getattr(ledger, "db", ledger).engine,
        "commit",
        lambda conn: ended.__setitem__(0, ended[0] + 1),
    )
    event.listen(
        getattr(ledger, "db", ledger).engine,
        "rollback",
        lambda conn: ended.__setitem__(0, ended[0] + 1),
    )
    job = NewJob(
        scope=f"{TEAM}/agent-{os.getpid()}",
        name="burst",
        instance_type="local:box",
        provisioning="on-demand",
        nodes=1,
        rate_micro_per_hour=RATE_CENTS * 10_000,
        rate_cents=RATE_CENTS,
        priority=0,
        max_runtime_s=3600.0,
        expected_runtime_s=None,
        holder=holder_id(),
    )
    errors: list[str] = []
    getattr(ledger, "config", ledger).budgets(ORG)  # connected: the first request pays no connect
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())

    def ask() -> None:
        time.sleep(max(0.0, start_at - time.time()))
        try:
            getattr(ledger, "queue", ledger).ask(job, str(uuid.uuid4()))
        except Exception as exc:  # counted, not raised: the burst goes on
            errors.append(f"{type(exc).__name__}: {exc}")

    pool = [threading.Thread(target=ask) for _ in range(threads)]
    ended[0] = 0
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    report = {"transactions": ended[0], "errors": errors[:3], "failed": len(errors)}
    print(json.dumps({**report, "package": str(Path(prefect_gpu_budget.__file__).parent.parent)}))
    getattr(ledger, "db", ledger).dispose()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
