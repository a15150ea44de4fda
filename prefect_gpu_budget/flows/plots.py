"""The sweep, forecast and spend-report plots now live in `prefect_gpu_budget.plots`.

Kept so that `from prefect_gpu_budget.flows import plots` goes on working; import
`prefect_gpu_budget.plots` in new code.
"""

from __future__ import annotations

from prefect_gpu_budget.plots import embed as embed
from prefect_gpu_budget.plots import learning_curves as learning_curves
from prefect_gpu_budget.plots import metric_vs_params as metric_vs_params
from prefect_gpu_budget.plots import spend_over_time as spend_over_time
