"""`pool set` and `pool quota` racing in real processes: every quota and the pool's change survive."""

from __future__ import annotations

from prefect_gpu_budget.admission.ledger import Ledger
from tests.cli.support import race


def test_racing_quotas_and_pool_set_all_survive(url: str) -> None:
    ledger = Ledger(url)
    try:
        pool = ["pool", "set", "acme", "lab", "--nodes", "4", "--gpus-per-node", "8"]
        assert race(url, [pool]) == [0]
        teams = [f"team-{i}" for i in range(6)]
        commands = [
            ["pool", "quota", f"acme/{team}", "--pool", "lab", "--gpus", str(i + 1)]
            for i, team in enumerate(teams)
        ]
        commands.append([*pool, "--gpu-model", "h100"])  # the pool changes while quotas land
        assert race(url, commands) == [0] * len(commands)
        [lab], quotas = ledger.config.capacity("acme")
        assert {q.team: q.quota[0] for q in quotas} == {
            f"acme/{team}": i + 1 for i, team in enumerate(teams)
        }
        assert lab.gpu_model == "h100"
    finally:
        ledger.db.dispose()
