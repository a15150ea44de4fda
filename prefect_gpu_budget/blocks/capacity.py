"""`CapacityPool`: what can run at once, and each team's quota of it, as a Prefect block."""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field

from prefect_gpu_budget.admission.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.units import Scope


class TeamShare(BaseModel):
    """A team's quota in a pool. Giving only `gpus` sets vCPU and memory in proportion."""

    model_config = ConfigDict(extra="forbid")

    team: Scope = Field(description="'org/team'.")
    gpus: int = Field(ge=0, le=100_000, description="Accelerators guaranteed to the team.")
    vcpu: int | None = Field(None, ge=0, description="Default: in proportion to `gpus`.")
    memory_gib: int | None = Field(None, ge=0, description="Default: in proportion to `gpus`.")
    borrow_pct: int = Field(0, ge=0, le=1000, description="May borrow this % of its quota more.")
    lend_pct: int = Field(100, ge=0, le=100, description="% of its idle quota others may borrow.")
    weight: int = Field(50, ge=0, le=100, description="Fair share of idle capacity (0 = last).")


class CapacityPool(Block):
    """Machines (an on-prem inventory: `nodes` of one shape) or a cloud quota (totals only)
    that jobs of some instance types run on, and the teams' quotas of it.

    A job is admitted only when all its nodes fit at once, its team's quota (plus what it may
    borrow of idle capacity) allows it, and every budget on its path does.
    """

    _block_type_name = "GPU Capacity Pool"
    _block_type_slug = "gpu-capacity-pool"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "GPU machines or a cloud GPU quota, with per-team quotas, lending and borrowing."

    org: Scope = Field(description="The org whose jobs use this pool.")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,47}$", description="e.g. 'lab-a'.")
    nodes: int = Field(ge=1, le=100_000, description="Machines (or quota units) in the pool.")
    gpus_per_node: int = Field(ge=0, le=64, description="Accelerators in each machine.")
    vcpu_per_node: int = Field(0, ge=0, le=100_000, description="vCPU in each machine.")
    memory_gib_per_node: int = Field(
        0, ge=0, le=10_000_000, description="Memory of each machine, GiB."
    )
    gpu_model: str = Field("", max_length=64, description="Shown in reasons, e.g. 'H100'.")
    instance_types: list[str] = Field(
        default_factory=list, description="Jobs on these instance types run here."
    )
    kind: Literal["inventory", "quota"] = Field(
        "inventory", description="inventory: each job node on its own machine; quota: totals."
    )
    backfill: bool = Field(False, description="Let small jobs pass a blocked big one.")
    teams: list[TeamShare] = Field(
        default_factory=list, description="Each team's quota, borrow and lend limits, weight."
    )

    def pool(self) -> Pool:
        return Pool(
            org=self.org,
            name=self.name,
            nodes=self.nodes,
            node=(self.gpus_per_node, self.vcpu_per_node, self.memory_gib_per_node),
            instance_types=tuple(self.instance_types),
            gpu_model=self.gpu_model,
            kind=self.kind,
            backfill=self.backfill,
        )

    def quotas(self) -> list[TeamQuota]:
        pool = self.pool()
        return [
            TeamQuota(
                pool=self.name,
                team=t.team,
                quota=proportional(pool, t.gpus, t.vcpu, t.memory_gib),
                borrow_pct=t.borrow_pct,
                lend_pct=t.lend_pct,
                weight=t.weight,
            )
            for t in self.teams
        ]

    def apply(self, ledger: object | None = None) -> None:
        """Write the pool and its team quotas into the ledger (the default one unless given)."""
        from prefect_gpu_budget.blocks.ledger import SpendLedger

        (ledger or SpendLedger().ledger()).set_pool(self.pool(), self.quotas())
