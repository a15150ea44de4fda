"""The routes a job asking for accelerators may take: the ledger's capacity pools and the
admin's saved launcher blocks, as `offerings.Route`s.

- A capacity pool is a route of the `local` cloud on demand, named for the pool; its machines
  are the `local:<name>` types the ledger's local prices price, and its accelerator model the
  one those rows name (else the pool's own).
- A Vertex AI launcher (`launchers.vertex.VertexLauncher`) runs on-demand, spot and flex-start
  in its `region`, priced under `gcp`.
- A SageMaker launcher (`launchers.sagemaker.SageMakerLauncher`) runs on-demand and, when it has
  a `checkpoint_s3_uri` (which managed spot needs: its `preflight` refuses spot without one),
  spot, in its AWS credentials' region (else the AWS profile's or environment's), priced under
  `sagemaker`.

Other launchers (a deployment's, the local one) are no route: they run a machine the job names.
`saved_launchers` reads the saved blocks from the Prefect API; Prefect is imported only there.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection, Iterable

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import Ledger, pools
from prefect_gpu_budget.admission.ledger.engine import reconnecting
from prefect_gpu_budget.admission.ledger.tables import local_prices
from prefect_gpu_budget.placement.offerings import Route
from prefect_gpu_budget.pricing.catalog import LOCAL_CPU, LOCAL_GPU

logger = logging.getLogger(__name__)

VERTEX_PROVISIONINGS = ("on-demand", "spot", "flex-start")
SAGEMAKER_PROVISIONINGS = ("on-demand", "spot")
LAUNCHER_BLOCKS = (
    ("prefect_gpu_budget.launchers.vertex", "VertexLauncher"),
    ("prefect_gpu_budget.launchers.sagemaker", "SageMakerLauncher"),
)
"""The saved launcher blocks that are routes: (module, class)."""


UNNAMED_MODELS = ("", LOCAL_GPU, LOCAL_CPU)
"""What a `local:` row priced without a model says (`pricing.catalog.local_row`): no model."""


def _gpu_model(pool_gpu_model: str, instance_types: str, local_models: dict[str, str]) -> str:
    """The accelerator model the pool's `local:` rows name, if they agree on one; else the
    pool's own."""
    named = {
        local_models[t]
        for t in instance_types.split(",")
        if t and local_models.get(t, "") not in UNNAMED_MODELS
    }
    return named.pop() if len(named) == 1 else pool_gpu_model


@reconnecting
def pool_routes(ledger: Ledger, *, org: str | None = None) -> list[Route]:
    """Each capacity pool in `ledger` (of `org` only, when given), by org and name: a route on
    demand of the `local` cloud, named for the pool."""
    query = sa.select(pools.c.name, pools.c.gpu_model, pools.c.instance_types).order_by(
        pools.c.org, pools.c.name
    )
    if org is not None:
        query = query.where(pools.c.org == org)
    with ledger.db.read() as conn:
        found = conn.execute(query).all()
        models = {
            f"local:{name}": model
            for name, model in conn.execute(
                sa.select(local_prices.c.name, local_prices.c.gpu_model)
            )
        }
    routes = []
    for row in found:
        model = _gpu_model(row.gpu_model or "", row.instance_types or "", models)
        routes.append(
            Route(
                launcher=row.name,
                cloud="local",
                pool=row.name,
                provisionings=("on-demand",),
                gpu_model=model or None,
                instance_types=tuple(t for t in (row.instance_types or "").split(",") if t),
            )
        )
    return routes


def _sagemaker_region(block: object) -> str:
    """The region a SageMaker launcher's jobs run in; "" where it resolves none here (its own
    check refuses the job when it is launched)."""
    credentials = getattr(block, "aws_credentials", None)
    region = getattr(credentials, "region_name", None)
    if region:
        return region
    from prefect_gpu_budget.launchers.base import LaunchConfigError

    try:
        return block.region()  # type: ignore[attr-defined]
    except LaunchConfigError:
        return ""


def launcher_route(name: str, block: object) -> Route | None:
    """The route of one saved launcher block named `name`; None for a launcher that is none."""
    kind = getattr(block, "kind", None)
    if kind == "vertex":
        return Route(
            launcher=name,
            cloud="gcp",
            regions=(getattr(block, "region", "") or "",),
            provisionings=VERTEX_PROVISIONINGS,
        )
    if kind == "sagemaker":
        spot = bool(getattr(block, "checkpoint_s3_uri", None))
        return Route(
            launcher=name,
            cloud="sagemaker",
            regions=(_sagemaker_region(block),),
            provisionings=SAGEMAKER_PROVISIONINGS if spot else ("on-demand",),
        )
    return None


LAUNCHER_KINDS = {"gcp": "vertex", "sagemaker": "sagemaker"}
"""The launcher kind that starts a cloud's offerings: how a saved block is named in an agent's
limits (`AgentLimits.launchers`: `vertex:NAME`, `sagemaker:NAME`)."""


def route_ref(cloud: str, launcher: str) -> str:
    """How agents' limits name the route of an offering on `cloud` started by `launcher`:
    `vertex:NAME`, `sagemaker:NAME`, or `local` for a pool's (the local launcher's)."""
    kind = LAUNCHER_KINDS.get(cloud)
    return f"{kind}:{launcher}" if kind else "local"


def allowed_routes(routes: Iterable[Route], allowed: Collection[str] | None) -> list[Route]:
    """The routes an agent's limits grant (`allowed`: its team's `AgentLimits.launchers`);
    every route where no limits apply (None)."""
    if allowed is None:
        return list(routes)
    return [r for r in routes if route_ref(r.cloud, r.launcher) in allowed]


def launcher_routes(named: Iterable[tuple[str, object]]) -> list[Route]:
    """The routes of saved launcher blocks, each with its name (blank: the block's own saved
    name); a block that is no Vertex AI or SageMaker launcher, or has no name, is left out."""
    routes = []
    for name, block in named:
        name = name or getattr(block, "_block_document_name", None) or ""
        route = launcher_route(name, block) if name else None
        if route is not None:
            routes.append(route)
    return routes


def saved_launchers() -> list[tuple[str, object]]:
    """Every VertexLauncher and SageMakerLauncher block saved in the configured Prefect API, by
    name. None without `PREFECT_API_URL` (no temporary server is started for this), and none of
    a kind whose extra is not installed or whose block type was never registered."""
    from prefect_gpu_budget.settings import prefect_api_url

    if not prefect_api_url():
        return []
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    found: list[tuple[str, object]] = []
    with get_client(sync_client=True) as client:
        for module, name in LAUNCHER_BLOCKS:
            try:
                block_class = getattr(importlib.import_module(module), name)
            except ImportError as exc:  # its cloud's extra is not installed
                logger.debug("no %s: %s", name, exc)
                continue
            try:
                documents = client.read_block_documents_by_type(
                    block_class.get_block_type_slug(), include_secrets=False
                )
            except (ObjectNotFound, PrefectHTTPStatusError) as exc:
                if getattr(getattr(exc, "response", None), "status_code", 404) != 404:
                    raise
                continue  # its block type was never registered here: none saved
            for document in documents:
                if document.name and not document.is_anonymous:
                    found.append((document.name, block_class.load(document.name)))
    return sorted(found, key=lambda pair: pair[0])
