"""Which run of the suite owns a process or a database, so that an interrupted run leaves none.

A run is its top pytest process (the controller of its xdist workers, or the only process),
named by `OWNER`: `<pid>_<start>_<place>`, its pid, its start time (clock ticks since boot) and
`PLACE` (this boot and pid namespace: where that pid means that process). Every process the
run starts carries `MARK=<owner>` in its environment (tests/conftest.py sets it in its own, so
it is inherited), and every database it creates is named for it (tests/support/postgres.py).

So a run can end what it started however it was stopped (tests/conftest.py does at its end),
and a later run can tell what an earlier one that was killed left: the processes and databases
of an owner that no longer runs (`ended`). What another place named is never judged ended."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

MARK = "GPU_BUDGET_TEST_RUN"
_OWNER = re.compile(r"(\d+)_\d+_([0-9a-f]{6})")


def _place() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    where = f"{boot} {os.readlink('/proc/self/ns/pid')}"
    return hashlib.sha256(where.encode()).hexdigest()[:6]


PLACE = _place()


def tag(pid: int) -> str | None:
    """The owner name of process `pid` as it runs now; None when it has ended (or is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return f"{pid}_{fields[19]}_{PLACE}"  # field 22 of proc(5): the start time


def ended(owner: str) -> bool:
    """Whether the run `owner` names is over: a pid of this place that no longer runs, or that
    now runs another process (it started at another time). Never for a name of another form."""
    found = _OWNER.fullmatch(owner)
    return found is not None and found[2] == PLACE and tag(int(found[1])) != owner


def _owner() -> str:
    """An xdist worker's run is its controller's (its parent, which marked itself); any other
    pytest process, a run started from a test included, is a run of its own."""
    inherited = os.environ.get(MARK)
    if os.environ.get("PYTEST_XDIST_WORKER") and inherited == tag(os.getppid()):
        return inherited
    own = tag(os.getpid())
    assert own is not None
    return own


OWNER = _owner()


def marked() -> dict[int, str]:
    """The processes (but this one) that carry `MARK`, each with the owner it names."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # ended, or another user's
            continue
        for variable in environ.split(b"\0"):
            if variable.startswith(f"{MARK}=".encode()):
                found[int(entry.name)] = variable.split(b"=", 1)[1].decode(errors="replace")
                break
    return found


def end_processes(whose: Callable[[str], bool], grace: float = 15.0) -> None:
    """SIGINT the processes of the owners `whose` picks, as Ctrl-C would have (they clean up
    after themselves), and SIGKILL those still there `grace` s later."""

    def left() -> list[int]:
        return [pid for pid, owner in marked().items() if whose(owner)]

    def send(pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    send(left(), signal.SIGINT)
    deadline = time.monotonic() + grace
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    send(left(), signal.SIGKILL)
