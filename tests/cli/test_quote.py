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


def test_quote_by_accelerators_shows_every_saved_offering_and_the_choice(
    prefect_api: str, tmp_path: Path
) -> None:
    """`quote --accelerators` against a real Prefect API holding a saved Vertex AI and a saved
    SageMaker launcher, and a ledger with a pool of the team's: every offering, the cheapest
    that fits CHOSEN, and why each other was passed over; then with the pool's quota in use."""
    import json
    import uuid

    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.prices import set_ledger_price
    from prefect_gpu_budget.admission.rules.policy import BudgetRule
    from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota
    from tests.placement.test_routes import _sagemaker, _vertex

    vertex, sagemaker = f"vx-{uuid.uuid4().hex[:8]}", f"sm-{uuid.uuid4().hex[:8]}"
    _vertex("us-central1").save(vertex, overwrite=True)
    _sagemaker("us-east-1", "s3://lab/checkpoints").save(sagemaker, overwrite=True)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    node = (8, 192, 2048)
    set_ledger_price("h100x8", "15", 8, ledger=ledger, vcpu=192, memory_gib=2048)
    ledger.config.set_pool(
        Pool("acme", "lab-a", 1, node, ("local:h100x8",), "H100"),
        [TeamQuota("lab-a", "acme/vision", node)],
    )
    ledger.config.set_budget(
        BudgetRule("acme", hourly_cap_cents=100_000, period_budget_micro=10**11)
    )
    ledger.db.dispose()
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    asked = ["--ledger-url", url, "quote", "--accelerators", "H100:8", "--hours", "2"]

    out = cli_run(env, *asked, "--scope", "acme/vision/s1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    launchers = {r["launcher"] for r in rows}
    assert {"lab-a", vertex, sagemaker} <= launchers
    chosen = [r for r in rows if r["chosen"]]
    assert [(c["instance_type"], c["pool"]) for c in chosen] == [("local:h100x8", "lab-a")]
    assert all(r["passed_over"] for r in rows if not r["chosen"])
    assert rows == sorted(
        rows, key=lambda r: (r["expected_usd"], r["expected_end_s"], r["offering"])
    )

    other = cli_run(env, *asked, "--scope", "acme/nlp/s1")
    assert other.returncode == 0, other.stderr
    assert "pool lab-a: acme/nlp has no quota there" in " ".join(other.stdout.split())
    assert "chosen: gcp:a3-highgpu-8g spot us-central1" in other.stdout

    never = cli_run(env, *asked, "--deadline", "1h")
    assert never.returncode == 2
    assert never.stderr.startswith("error: deadline: is before the job could end")
