from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.blocks import GpuBudget, SpendLedger
from prefect_gpu_budget.units import BudgetInputError


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


def test_block_register_finds_every_block() -> None:
    """`prefect block register -m prefect_gpu_budget` registers what `inspect.getmembers` finds."""
    from prefect.blocks.core import Block

    import prefect_gpu_budget

    found = {
        name for name, cls in inspect.getmembers(prefect_gpu_budget) if Block.is_block_class(cls)
    }
    assert found == {
        "BillingExport",
        "CapacityPool",
        "DeploymentLauncher",
        "GpuBudget",
        "GpuPriorityClass",
        "SageMakerLauncher",
        "SpendLedger",
        "VertexLauncher",
    }


def test_collection_loader_registers_the_blocks() -> None:
    """Prefect's collection loader (run by servers, workers and `Block.load` by slug) makes the
    budget blocks known by their slugs in a fresh process."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from prefect.plugins import load_prefect_collections; load_prefect_collections();"
            "from prefect.blocks.core import Block;"
            "print(Block.get_block_class_from_key('gpu-budget').__name__,"
            " Block.get_block_class_from_key('gpu-spend-ledger').__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.stdout.split() == ["GpuBudget", "SpendLedger"], done.stderr[-2000:]


def test_apply_refuses_a_near_miss_as_budget_set_does(tmp_path: Path) -> None:
    """`GpuBudget.apply()` and `budget set` are one act (`admission.budgets.set_budget`): a
    typo that would make a new team is refused, and `new=True` makes it all the same."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    GpuBudget(scope="acme", hourly_cap_usd=60).apply(ledger)
    GpuBudget(scope="acme/vision", hourly_cap_usd=20).apply(ledger)
    with pytest.raises(BudgetInputError) as refused:
        GpuBudget(scope="acme/visoin/agent-7", hourly_cap_usd=5).apply(ledger)
    assert str(refused.value) == (
        "scope: acme/visoin has no budget; did you mean acme/vision? (--new creates it)"
    )
    assert {r.scope for r in ledger.config.budgets()} == {"acme", "acme/vision"}
    GpuBudget(scope="acme/visoin/agent-7", hourly_cap_usd=5).apply(ledger, new=True)
    assert "acme/visoin/agent-7" in {r.scope for r in ledger.config.budgets()}
    ledger.db.dispose()


def test_apply_warns_as_budget_set_does(tmp_path: Path, caplog) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    assert GpuBudget(scope="acme", hourly_cap_usd=60).apply(ledger) == []
    warned = GpuBudget(scope="acme/vision", hourly_cap_usd=500).apply(ledger)
    said = "the cap $500.00/h of acme/vision is above the $60.00/h of acme, which binds"
    assert warned == [said] and said in caplog.text
    rounded = GpuBudget(scope="acme", hourly_cap_usd="3.605").apply(ledger)
    assert rounded[0].startswith("the cap $3.605/h of acme is kept as $3.60/h")
    ledger.db.dispose()


def test_apply_resizes_the_prefect_limit_as_budget_set_does(tmp_path: Path, monkeypatch) -> None:
    """A new cap shows in Prefect's limit at once, not at the scope's next admission."""
    patched: list[tuple[str, dict]] = []

    class Api(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:  # noqa: N802 - the handler's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            patched.append((self.path, json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{server.server_port}/api")
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    try:
        assert GpuBudget(scope="acme", hourly_cap_usd="7.2").apply(ledger) == []
    finally:
        server.shutdown()
        ledger.db.dispose()
    assert patched == [("/api/v2/concurrency_limits/gpu-budget%3Aacme", {"limit": 720})]
