"""The routes a job asking for accelerators may take (placement/routes.py): the ledger's capacity
pools, each named for itself with its local machines' accelerator model; the saved Vertex AI and
SageMaker launchers, each in its region with the provisionings it can ask for; and no saved
launcher at all, and no temporary Prefect server started, without PREFECT_API_URL."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.ledger.local_prices import LocalPrices
from prefect_gpu_budget.admission.rules.quota import Pool
from prefect_gpu_budget.placement.offerings import Route
from prefect_gpu_budget.placement.routes import (
    launcher_routes,
    pool_routes,
    route_ref,
    saved_launchers,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield led
    led.db.dispose()


def _local(ledger: Ledger, name: str, gpu_model: str, gpus: int = 8) -> None:
    LocalPrices(ledger.db).set(
        {
            "name": name,
            "usd_per_hour": "12.5",
            "gpu_model": gpu_model,
            "gpus": gpus,
            "vcpu": 96,
            "memory_gib": 1000,
            "source": "the lab's own",
            "as_of": "2026-01-01",
        }
    )


def test_each_pool_is_a_local_route_named_for_itself(ledger: Ledger) -> None:
    _local(ledger, "dgx-a", "H100 80GB")
    ledger.config.set_pool(
        Pool("lab", "dgx", nodes=4, node=(8, 96, 1000), instance_types=("local:dgx-a",))
    )
    ledger.config.set_pool(  # its machine has no local row: the pool's own model
        Pool("lab", "l4s", nodes=2, node=(1, 8, 32), gpu_model="L4 24GB")
    )
    ledger.config.set_pool(Pool("other", "cpu", nodes=1, node=(0, 8, 32)))

    assert pool_routes(ledger) == [
        Route(
            "dgx",
            "local",
            ("",),
            ("on-demand",),
            pool="dgx",
            gpu_model="H100 80GB",
            instance_types=("local:dgx-a",),  # the pool offers only its own machines
        ),
        Route("l4s", "local", ("",), ("on-demand",), pool="l4s", gpu_model="L4 24GB"),
        Route("cpu", "local", ("",), ("on-demand",), pool="cpu", gpu_model=None),
    ]
    assert [r.pool for r in pool_routes(ledger, org="lab")] == ["dgx", "l4s"]


def test_a_ledger_without_pools_has_no_pool_route(ledger: Ledger) -> None:
    _local(ledger, "dgx-a", "H100 80GB")
    assert pool_routes(ledger) == []


def _vertex(region: str):
    from prefect_gcp import GcpCredentials

    from prefect_gpu_budget.launchers.vertex import VertexLauncher
    from tests.support.gcp_server import service_account_info

    credentials = GcpCredentials(service_account_info=service_account_info()[0])
    return VertexLauncher(gcp_credentials=credentials, region=region)


def _sagemaker(region: str | None, checkpoints: str | None):
    from prefect_aws import AwsCredentials

    from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher

    return SageMakerLauncher(
        aws_credentials=AwsCredentials(region_name=region), checkpoint_s3_uri=checkpoints
    )


def test_launcher_blocks_are_routes_in_their_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_gpu_budget.launchers.deployment import DeploymentLauncher

    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    saved_as = _vertex("us-central1")
    saved_as._block_document_name = "vertex-saved"
    named = [
        ("vertex-eu", _vertex("europe-west4")),
        ("", saved_as),  # no name given: its own saved name
        ("sm-spot", _sagemaker("us-east-1", "s3://lab/checkpoints")),
        ("sm-plain", _sagemaker(None, None)),  # the environment's region; no spot
        ("deploy", DeploymentLauncher(deployment="train/gpu")),  # runs what the job names
        ("", _vertex("us-east1")),  # no name at all: nothing could start it
    ]
    assert launcher_routes(named) == [
        Route("vertex-eu", "gcp", ("europe-west4",), ("on-demand", "spot", "flex-start")),
        Route("vertex-saved", "gcp", ("us-central1",), ("on-demand", "spot", "flex-start")),
        Route("sm-spot", "sagemaker", ("us-east-1",), ("on-demand", "spot")),
        Route("sm-plain", "sagemaker", ("eu-west-1",), ("on-demand",)),
    ]


def test_no_saved_launchers_and_no_server_without_an_api_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import prefect.client.orchestration

    def no_client(*args: object, **kwargs: object) -> None:
        raise AssertionError("asked Prefect for a client with no PREFECT_API_URL")

    monkeypatch.setattr(prefect.client.orchestration, "get_client", no_client)
    monkeypatch.setenv("PREFECT_API_URL", "")
    assert saved_launchers() == []
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_PROFILES_PATH", "/nonexistent/profiles.toml")
    monkeypatch.chdir(ROOT / "tests" / "placement")  # no settings file of Prefect's here
    assert saved_launchers() == []


def test_the_routes_and_the_history_import_without_prefect() -> None:
    probe = (
        "import sys, prefect_gpu_budget.placement.routes, prefect_gpu_budget.placement.history; "
        "print('prefect' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_saved_launchers_are_read_from_the_api_by_name(prefect_api: str) -> None:
    vertex, sagemaker = f"vx-{uuid.uuid4().hex[:8]}", f"sm-{uuid.uuid4().hex[:8]}"
    _vertex("europe-west4").save(vertex, overwrite=True)
    _sagemaker("us-east-1", "s3://lab/checkpoints").save(sagemaker, overwrite=True)

    found = dict(saved_launchers())

    assert {vertex, sagemaker} <= set(found)
    assert launcher_routes([(vertex, found[vertex]), (sagemaker, found[sagemaker])]) == [
        Route(vertex, "gcp", ("europe-west4",), ("on-demand", "spot", "flex-start")),
        Route(sagemaker, "sagemaker", ("us-east-1",), ("on-demand", "spot")),
    ]


def test_a_block_type_never_registered_is_no_saved_launcher(tmp_path: Path) -> None:
    """A fresh Prefect server, where no launcher block type was ever registered, answers 404
    for their documents: that is no saved launcher, not an error."""
    from prefect_gpu_budget.testing.servers import serving
    from tests.support.prefect_server import PrefectServer

    with PrefectServer(tmp_path / "home") as server, serving(server.api):
        assert saved_launchers() == []


def test_a_vertex_and_a_sagemaker_launcher_may_share_a_name(
    monkeypatch: pytest.MonkeyPatch, ledger: Ledger
) -> None:
    """Each saved block is its own route and its own block, named as agents' limits name them
    (`vertex:NAME`, `sagemaker:NAME`): one name for both used to keep only the last."""
    from prefect_gpu_budget.placement import placing

    vertex, sagemaker = _vertex("europe-west4"), _sagemaker("us-east-1", None)
    monkeypatch.setattr(placing, "saved_launchers", lambda: [("prod", vertex), ("prod", sagemaker)])
    routes, blocks = placing.saved_routes(ledger, "acme")
    assert [(r.launcher, r.cloud) for r in routes] == [("prod", "gcp"), ("prod", "sagemaker")]
    assert blocks == {"vertex:prod": vertex, "sagemaker:prod": sagemaker}
    assert route_ref("gcp", "prod") == "vertex:prod" and route_ref("local", "lab-a") == "local"
