"""`python -m prefect_gpu_budget.cli`: the same as the `prefect-gpu-budget` command."""

from prefect_gpu_budget.cli import main

main()
