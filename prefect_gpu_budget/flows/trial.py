"""The trial runner where users first met it: `python -m prefect_gpu_budget.flows.trial mod:fn
'{"lr": 0.1}'` and `from prefect_gpu_budget.flows.trial import report` work as before. It lives
with the sweep, in `prefect_gpu_budget/sweeps/trial.py`; standard library only, as there."""

from __future__ import annotations

import sys

from prefect_gpu_budget.sweeps.trial import main, report

__all__ = ["main", "report"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
