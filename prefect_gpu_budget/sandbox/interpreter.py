"""The Python an agent's job gets (`Sandbox.prepare`): `python` and `python3` first on its PATH,
starting the interpreter `Sandbox.interpreter` picks, and a PYTHONPATH that reaches the trial
runner (`python -m prefect_gpu_budget.sweeps.trial`, standard library only): this package's
source checkout where the job's user can read it, else (installed, or out of reach) a copy of
the few files the runner imports (`TRIAL_SOURCES`). Both live in the job's folder, in
`TOOLS_DIR` (the worker's, 0755).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from prefect_gpu_budget.sandbox.users import JobUser, unreachable

PYTHON_NAMES: tuple[str, ...] = ("python", "python3")
"""The names the job's PATH gives the interpreter (`bin/` of its `.gpu-budget` folder)."""
TRIAL_SOURCES: tuple[str, ...] = (
    "prefect_gpu_budget/__init__.py",
    "prefect_gpu_budget/_lazy.py",
    "prefect_gpu_budget/settings.py",
    "prefect_gpu_budget/sweeps/__init__.py",
    "prefect_gpu_budget/sweeps/trial.py",
)
"""Every file of this package that `python -m prefect_gpu_budget.sweeps.trial` imports."""
TOOLS_DIR = ".gpu-budget"
"""The folder, in the job's own, that holds `bin/` (PYTHON_NAMES) and `lib/` (TRIAL_SOURCES)."""


def package_source() -> str:
    """The folder this package is imported from, for the job's PYTHONPATH (so a trial,
    `python -m prefect_gpu_budget.sweeps.trial`, imports this very code)."""
    return str(Path(__file__).resolve().parents[2])


def is_python(program: str) -> bool:
    """Whether `program` is the job's interpreter: a name of PYTHON_NAMES, or this worker's."""
    return program in PYTHON_NAMES or program == sys.executable


def offer_python(tools: Path, user: JobUser, python: str | None) -> tuple[str | None, str]:
    """Fill `tools` (the worker's, 0755; files 0644): `bin/` with a `python` and a `python3`
    that start `python` (a script that `exec`s it, not a link: a venv's interpreter finds
    its venv only by the path it was started as), and `lib/` with a copy of TRIAL_SOURCES
    when `user` cannot read them where this package is, or when this package is installed
    (its folder, site-packages, holds every other package too, perhaps built for another
    Python). Returns the folder for the job's PATH (None without a `python`) and the one
    for its PYTHONPATH."""
    bin_dir = None
    if python is not None:
        bin_dir = tools / "bin"
        script = f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n'.encode()
        for name in PYTHON_NAMES:
            _write_file(bin_dir / name, script, 0o755)
    source = Path(package_source())
    if source.name not in ("site-packages", "dist-packages") and all(
        not unreachable(str(source / rel), user, os.R_OK) for rel in TRIAL_SOURCES
    ):
        return (str(bin_dir) if bin_dir else None), str(source)
    for rel in TRIAL_SOURCES:
        _write_file(tools / "lib" / rel, (source / rel).read_bytes(), 0o644)
    return (str(bin_dir) if bin_dir else None), str(tools / "lib")


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write a new file (never through a link), its folders made 0755, whatever the umask."""
    for folder in reversed([path.parent, *path.parent.parents]):
        if not folder.exists():
            folder.mkdir(mode=0o755)
            os.chmod(folder, 0o755)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)
