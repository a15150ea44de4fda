"""Which process holds a job, and whether it still lives (the standard library only).

A holder is `host:pid:start-ticks`: the start time read from `/proc` tells a reused pid from the
process that took the job, so a crashed holder's jobs are found as orphans. The ledger stores
holders, reconcile and the audit ask whether one is alive, and the local launcher names its
child processes the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable

_OWN_TICKS: dict[int, str] = {}
"""This process's start ticks, by pid (a forked child reads its own)."""


def holder_id() -> str:
    """`host:pid:start-ticks` of this process, so a reused pid is never mistaken for it (its
    start ticks read from `/proc` once, not at every admission)."""
    pid = os.getpid()
    ticks = _OWN_TICKS.get(pid)
    if ticks is None:
        ticks = _OWN_TICKS[pid] = process_start_ticks(pid)
    return f"{os.uname().nodename}:{pid}:{ticks}"


def process_start_ticks(pid: int) -> str:
    """The process's start time in clock ticks since boot; `?` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "?"
    return "?" if fields[0] in ("Z", "X") else fields[19]


def holder_alive(holder: str) -> bool | None:
    """True/False for a holder on this host; None where it runs elsewhere (use heartbeats)."""
    try:
        host, pid, ticks = holder.rsplit(":", 2)
    except ValueError:
        return None
    if host != os.uname().nodename:
        return None
    return process_start_ticks(int(pid)) == ticks and ticks != "?"


def live_processes(matches: Callable[[str], bool]) -> list[int]:
    """Live (not zombie) processes of this machine whose `/proc/<pid>` folder `matches` (the
    caller reads what it needs there; an OSError means no)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if not matches(f"/proc/{entry}"):
                continue
            with open(f"/proc/{entry}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except (OSError, IndexError):
            continue
        found.append(int(entry))
    return found
