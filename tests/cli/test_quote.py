"""`quote`: a part of a machine priced as the gate prices it, a whole one quickly, flex-start as
an upper bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cli.support import cli_run


def test_quote_prices_a_part_of_a_machine_by_its_largest_share() -> None:
    env = dict(os.environ)
    out = cli_run(env, "quote", "aws:p5.48xlarge", "--gpus", "2", "--vcpu", "96")
    assert out.returncode == 0, out.stderr
    assert "$27.52/h  1/2 of each node's price" in out.stdout  # 96 of 192 vCPU binds
    whole = cli_run(env, "quote", "aws:p5.48xlarge", "--gpus", "8")
    assert "$55.04/h  8x H100 80GB per node" in whole.stdout
    too_big = cli_run(env, "quote", "aws:p5.48xlarge", "--gpus", "9")
    assert too_big.returncode == 2
    assert too_big.stderr.strip() == "error: gpus: asks 9 GPUs, but aws:p5.48xlarge has 8"


_QUOTE_PROBE = """
import sys
from prefect_gpu_budget.cli import main
sys.argv = ["prefect-gpu-budget", "quote", "aws:g5.xlarge"]
try:
    main()
except SystemExit:
    pass
print("pydantic" in sys.modules, file=sys.stderr)
"""


def _shipped_prices(tmp_path: Path) -> dict[str, str]:
    """The environment of a CLI that reads the shipped catalog only."""
    return {
        **os.environ,
        "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "prices.csv"),
        "PREFECT_GPU_BUDGET_CATALOG_DIR": str(tmp_path / "catalogs"),
        "COLUMNS": "300",
    }


def test_quote_prices_a_part_as_the_gate_does_and_a_whole_machine_quickly(tmp_path) -> None:
    """Issue 31, point 7: `quote --gpus 1` of an 8-GPU machine is what the gate charges (1/8 of
    its price, to the micro-dollar; `admission.prices.price_job`); a whole machine's quote
    still loads no job model (pydantic)."""
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import SHIPPED, Catalog, read_price_file

    env = _shipped_prices(tmp_path)
    part = cli_run(env, "quote", "aws:p4d.24xlarge", "--gpus", "1")
    assert part.returncode == 0, part.stderr
    assert "x1: $2.74475/h  1/8 of each node's price (of 8x A100 40GB per node)" in part.stdout
    gate = Gate(None, catalog=Catalog(read_price_file(SHIPPED)))  # pricing reads no ledger
    job = GpuJob(instance_type="aws:p4d.24xlarge", gpus=1, max_runtime="1h")
    assert gate.quote(job).rate_micro_per_hour == 2_744_750
    done = subprocess.run(
        [sys.executable, "-c", _QUOTE_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.startswith("aws:g5.xlarge (on-demand) x1: $1.006/h"), done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_quote_of_flex_start_without_a_figure_says_it_is_an_upper_bound(tmp_path) -> None:
    """Issue 31, point 8: flex-start with no recorded figure is quoted at the on-demand price,
    said to be an upper bound; with no on-demand figure either, it is refused (exit 2)."""
    env = _shipped_prices(tmp_path)
    done = cli_run(env, "quote", "gcp:g2-standard-4", "--provisioning", "flex-start")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gcp:g2-standard-4 (flex-start) x1: $0.7068/h (upper bound)")
    assert (
        "upper bound: on-demand price; flex-start is billed at its own discounted rate"
        in done.stdout
    )
    refused = cli_run(env, "quote", "gcp:a3-highgpu-8g", "--provisioning", "flex-start")
    assert refused.returncode == 2 and "no public figure recorded" in refused.stderr
