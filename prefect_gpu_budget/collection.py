"""What Prefect's collection loader imports (`prefect.collections` entry point): the blocks,
so that they register by slug, and the worker types, so that `--type gpu-budget-process` and
`--type gpu-budget-vertex-ai` are known to `prefect work-pool create` and `prefect worker start`."""

from prefect_gpu_budget import blocks as blocks
from prefect_gpu_budget.workers import process as process
from prefect_gpu_budget.workers import vertex as vertex
