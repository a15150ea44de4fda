"""A trial's metrics file (`GPU_BUDGET_METRICS_FILE`, JSON lines), read as it grows, with bounds.

The file is the job's to write: it may hold lines of any length, bytes that are no JSON, or
gigabytes. `MetricsTail` reads what was appended since its last read, at most `CHUNK_BYTES` at
a time and `MAX_FILE_BYTES` in all, and never holds more than `MAX_LINE_BYTES` of one line: a
longer line is skipped to its end unread, so a job writing 100 MB lines costs its reader no
more memory than one writing short ones. Standard library only.

A record is passed on as JSON parses it: `NaN`, `Infinity`, `-Infinity` and `1e999` are floats
here, left out (and counted) where records are kept (`admission.ledger.trial_records.keep`), so that
they never stand in for the finite value a trial reported before them.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 64 * 1024
"""A longer record is skipped."""
CHUNK_BYTES = 1 << 20
"""At most this much is read at once."""
MAX_FILE_BYTES = 64 << 20
"""Nothing past this much of a file is read."""


class MetricsTail:
    """The records appended to one metrics file since the last `read`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.skipped = 0
        """Lines skipped: too long, not JSON, or not an object."""
        self._partial = b""
        self._overlong = False

    def read(self, final: bool = False) -> list[dict[str, Any]]:
        """The complete records appended since the last read (`final`: the job has ended, so
        a last line without its newline counts too)."""
        records: list[dict[str, Any]] = []
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return records
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO: nothing to read
            os.close(fd)
            return records
        with os.fdopen(fd, "rb") as handle:
            handle.seek(self.offset)
            while self.offset < MAX_FILE_BYTES:
                chunk = handle.read(min(CHUNK_BYTES, MAX_FILE_BYTES - self.offset))
                if not chunk:
                    break
                self.offset += len(chunk)
                self._take(chunk, records)
        if final and self._partial and not self._overlong:
            self._parse(self._partial, records)
            self._partial = b""
        return records

    def _take(self, chunk: bytes, records: list[dict[str, Any]]) -> None:
        lines = chunk.split(b"\n")
        for line in lines[:-1]:
            if self._overlong:  # the rest of a line too long to keep
                self._overlong = False
                self._partial = b""
                continue
            self._parse(self._partial + line, records)
            self._partial = b""
        tail = lines[-1]
        if self._overlong:
            return
        if len(self._partial) + len(tail) > MAX_LINE_BYTES:
            self._overlong, self._partial = True, b""
            self.skipped += 1
        else:
            self._partial += tail

    def _parse(self, line: bytes, records: list[dict[str, Any]]) -> None:
        if len(line) > MAX_LINE_BYTES:
            self.skipped += 1
            return
        if not line.strip():
            return
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            self.skipped += 1
            return
        if isinstance(item, dict):
            records.append(item)
        else:
            self.skipped += 1


def read_all(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a finished metrics file, within the same bounds."""
    return MetricsTail(path).read(final=True)
