"""A trial callable for the sandbox tests, which copy it where the sandbox's user can read it,
as `agent_trial.py` (`python -m prefect_gpu_budget.sweeps.trial agent_trial:train '{"lr": 0.5}'`):
standard library only, so any Python the sandbox's user can run imports it."""

from __future__ import annotations

import os
import sys
from typing import Any

from prefect_gpu_budget.sweeps.trial import report


def train(lr: float) -> dict[str, Any]:
    """Reports one step, and returns what the sandbox looks like from inside."""
    report(step=1, loss=lr)
    return {
        "loss": lr / 2,
        "uid": os.getuid(),
        "cwd": os.getcwd(),
        "home": os.environ.get("HOME"),
        "names": sorted(os.environ),
        "python": sys.executable,
        "runner": sys.modules["prefect_gpu_budget.sweeps.trial"].__file__,
    }
