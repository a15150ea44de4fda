"""An agent asks over MCP where a job asking for accelerators would run in its session: the
real door's answer (`Door.place`) on a real ledger, through the MCP SDK's own client; nothing
is reserved, and what no offering can do is a 422 tool error of one line."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from prefect_gpu_budget.admission.prices import set_ledger_price
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota
from prefect_gpu_budget.agents.door import Door
from tests.agents.mcp_client import call_tool, serving_mcp
from tests.agents.test_mcp import FakeDoor

NODE = (8, 192, 2048)


class PlacingDoor(FakeDoor):
    """The fake door's callers (its tokens), the real door's placement on a real ledger."""

    place = Door.place

    def __init__(self, ledger) -> None:  # noqa: ANN001 - a Ledger
        super().__init__()
        self.ledger = ledger


@pytest.fixture
def placing(ledger) -> Iterator[str]:
    set_ledger_price("h200x8", "12", 8, ledger=ledger, vcpu=192, memory_gib=2048)
    pool = Pool("team", "lab-a", 1, NODE, ("local:h200x8",), "H200")
    ledger.config.set_pool(pool, [TeamQuota("lab-a", "team/alice", NODE)])
    ledger.config.set_budget(
        BudgetRule("team", hourly_cap_cents=50_000, period_budget_micro=10**11)
    )
    with serving_mcp(PlacingDoor(ledger)) as url:
        yield url


def test_an_agent_asks_over_mcp_where_its_job_would_run(placing, ledger) -> None:
    is_error, content = call_tool(
        placing, "gpub_alice", "place", {"accelerators": "H200:8", "hours": 2}
    )
    assert not is_error, content
    answer = json.loads(content[0].text)
    chosen = answer["chosen"]
    assert (chosen["instance_type"], chosen["pool"], chosen["chosen"]) == (
        "local:h200x8",
        "lab-a",
        True,
    )
    assert chosen["expected_usd"] == 24.0 and chosen["reserved_usd"] == pytest.approx(24.03, 0.01)
    assert answer["considered"][0] == chosen
    assert ledger.views.jobs() == []  # nothing recorded, nothing reserved

    is_error, content = call_tool(
        placing, "gpub_alice", "place", {"accelerators": "H20:8", "hours": 2}
    )
    assert is_error
    assert content[0].text.startswith("422: accelerators: no offering has H20 (did you mean")
