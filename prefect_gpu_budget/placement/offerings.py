"""Offerings: every way the admin's launchers and pools can run a job that asks for
accelerators. A route is one launcher (or one capacity pool) with the clouds' provisionings it
can ask for in each of its regions; an offering is one catalog machine on one route, in one
region, with one provisioning, and the limits of that cloud (flex-start at most 7 days of run,
SageMaker at most 28)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from prefect_gpu_budget.placement.accelerators import Shape

DAY_S = 86400
RUNTIME_LIMIT_S: Mapping[tuple[str, str], float] = {
    ("gcp", "flex-start"): 7 * DAY_S,  # Vertex DWS: the job's timeout is at most 7 days
    ("sagemaker", "on-demand"): 28 * DAY_S,  # SageMaker training: MaxRuntimeInSeconds
    ("sagemaker", "spot"): 28 * DAY_S,
}
"""The most a job may run, per cloud and provisioning, where the cloud sets one."""


@dataclass(frozen=True)
class Route:
    """One launcher or pool the admin saved, and what it can ask of its cloud."""

    launcher: str
    """The saved launcher's (or pool's) name: where an offering on this route is started."""
    cloud: str
    """The catalog's cloud its machines are priced under: `gcp`, `sagemaker`, `local`."""
    regions: tuple[str, ...] = ("",)
    provisionings: tuple[str, ...] = ("on-demand",)
    pool: str | None = None
    """A capacity pool: the team's quota there decides, and its `local:` rows price it."""
    gpu_model: str | None = None
    """A pool's accelerator model, where its `local:` rows do not name one."""
    instance_types: tuple[str, ...] = ()
    """A pool's machines (`local:<name>`): it offers only these."""


@dataclass(frozen=True)
class Offering:
    """One way to run the job: a machine, a provisioning, a region, a launcher."""

    cloud: str
    instance_type: str
    provisioning: str
    region: str
    launcher: str
    gpu_model: str
    gpus: int
    rate_micro_per_hour: int
    """Per node, from the catalog (a flex-start row with no figure: its on-demand bound)."""
    pool: str | None = None
    runtime_limit_s: float | None = None

    @property
    def key(self) -> str:
        return f"{self.cloud}:{self.instance_type}"

    def describe(self) -> str:
        """`gcp:a3-highgpu-8g flex-start us-central1 (vertex-prod)`."""
        where = f" {self.region}" if self.region else ""
        return f"{self.key} {self.provisioning}{where} ({self.launcher})"


def pool_shapes(shapes: Iterable[Shape], routes: Iterable[Route]) -> list[Shape]:
    """The catalog's machines with each pool's accelerator model on its `local:` machines (a
    local price row names none of its own), so that `H100:8` finds a pool of H100 nodes."""
    models = {
        key: route.gpu_model
        for route in routes
        if route.pool and route.gpu_model
        for key in route.instance_types
    }
    return [
        replace(s, gpu_model=models[k]) if (k := f"{s.cloud}:{s.instance_type}") in models else s
        for s in shapes
    ]


def offerings(
    shapes: Iterable[Shape],
    rates: Mapping[tuple[str, str], int],
    routes: Iterable[Route],
) -> list[Offering]:
    """Each matching machine (`shapes`, see `accelerators.matching`) on each route that runs its
    cloud, in each of the route's regions and provisionings that the catalog prices (`rates`:
    micro-dollars an hour by `(cloud:instance_type, provisioning)`)."""
    found = []
    shapes = list(shapes)
    for route in routes:
        for shape in shapes:
            if shape.cloud != route.cloud or shape.provisioning not in route.provisionings:
                continue
            key = f"{shape.cloud}:{shape.instance_type}"
            if route.instance_types and key not in route.instance_types:
                continue
            rate = rates.get((key, shape.provisioning))
            if rate is None:
                continue
            for region in route.regions:
                found.append(
                    Offering(
                        cloud=shape.cloud,
                        instance_type=shape.instance_type,
                        provisioning=shape.provisioning,
                        region=region,
                        launcher=route.launcher,
                        gpu_model=route.gpu_model or shape.gpu_model,
                        gpus=shape.gpus,
                        rate_micro_per_hour=rate,
                        pool=route.pool,
                        runtime_limit_s=RUNTIME_LIMIT_S.get((shape.cloud, shape.provisioning)),
                    )
                )
    return found
