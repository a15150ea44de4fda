"""The run logs of a task that ends in a failed state it returned (`OverBudget`,
`GpuJobFailed`, `TimedOut`, ...) say its reason once.

Prefect's task engine logs such a task twice: `Task run failed with state: ...` with
`exc_info=True` while no exception is active (printed as a `NoneType: None` line), then
`Finished in state X('reason')`. The filter on Prefect's task-run logger keeps the second: it
drops the first when no exception is active, and never prints `NoneType: None`. A task that
raised keeps its traceback.
"""

from __future__ import annotations

import logging

FAILED_WITH_STATE = "Task run failed with state:"


class ReasonOnce(logging.Filter):
    """Drop Prefect's `Task run failed with state:` line of a returned failed state (the
    `Finished in state` line that follows says the same); strip an empty `exc_info`."""

    def filter(self, record: logging.LogRecord) -> bool:
        no_exception = not record.exc_info or record.exc_info[0] is None
        if no_exception:
            record.exc_info = None
            if isinstance(record.msg, str) and record.msg.startswith(FAILED_WITH_STATE):
                return "Retries" in record.msg  # a retried task's line says more than its end
        return True


def install() -> None:
    """Once per process, on Prefect's task-run logger (records reach the console and the API
    through it)."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, ReasonOnce) for f in logger.filters):
        logger.addFilter(ReasonOnce())
