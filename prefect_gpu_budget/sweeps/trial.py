"""Run a Python callable as a sweep trial: `python -m prefect_gpu_budget.sweeps.trial mod:fn '{"lr": 0.1}'`.

The callable gets the parameters as keyword arguments and may call `report(step=..., loss=...)`
as it goes; the mapping it returns becomes the trial's final metrics. A trial runs inside a job's
time limit, so this module imports only the standard library (never Prefect).
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from prefect_gpu_budget.settings import metrics_file


def report(**metrics: Any) -> None:
    """Append one JSON line of metrics to the file the launcher named (if any)."""
    path = metrics_file()
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(metrics) + "\n")


def main(argv: list[str]) -> int:
    target, params = argv[0], json.loads(argv[1])
    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(**params)
    if isinstance(result, dict):
        report(summary=True, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
