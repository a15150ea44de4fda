"""What the tests of agents' sandboxed jobs share: a folder any user may enter, a price, and a
job run through the local launcher with its lines."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.sandbox.launcher import Sandbox


@contextmanager
def open_folder(prefix: str, parent: str | None = None) -> Iterator[Path]:
    """A fresh folder any user can enter (pytest's own tmp_path is root's alone), removed
    after."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def box_quote(prices: Path):
    """The price of the whole `local:box` machine, on demand."""
    return Catalog.load(prices).quote("local:box", 1, "on-demand")


def run_job(box: Sandbox, quote, command: list[str], **job) -> tuple[object, list[str]]:
    """Run `command` as a job in `box` (max_runtime 1m unless given): its result and lines."""
    lines: list[str] = []
    spec = GpuJob(instance_type="local:box", command=command, **{"max_runtime": "1m", **job})
    return LocalLauncher(box).run(spec, quote, log=lines.append), lines
