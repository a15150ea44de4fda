"""What a benchmark reads of processes and of the host from `/proc`: a process's memory,
threads and descriptors, and the CPU time the hypervisor stole from the host."""

from __future__ import annotations

import os
import re
from pathlib import Path


def _status_field(status: str, key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", status)[1])


def own_figures() -> dict[str, int]:
    """This process's resident memory (KiB), OS threads and open file descriptors."""
    status = Path("/proc/self/status").read_text()
    return {
        "rss_kib": _status_field(status, "VmRSS"),
        "threads": _status_field(status, "Threads"),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of process `pid` in MiB; None without a pid or once it is gone."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return _status_field(status, "VmRSS") / 1024


def cpu_steal() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat; (0, 0) where unreadable."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[7], sum(fields)
