"""What Vertex AI runs, as the Vertex launcher and worker name it: the regions that run custom
training jobs, the accelerator of each catalog GPU model and of each GPU machine family, the
scheduling strategy of each provisioning, and the (machine type, accelerator) of a quoted
catalog row (`vertex_machine`)."""

from __future__ import annotations

from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.pricing.catalog import Quote

VERTEX_TRAINING_REGIONS = frozenset(
    {
        "africa-south1",
        "asia-east1",
        "asia-east2",
        "asia-northeast1",
        "asia-northeast2",
        "asia-northeast3",
        "asia-south1",
        "asia-southeast1",
        "asia-southeast2",
        "australia-southeast1",
        "australia-southeast2",
        "europe-central2",
        "europe-north1",
        "europe-southwest1",
        "europe-west1",
        "europe-west2",
        "europe-west3",
        "europe-west4",
        "europe-west6",
        "europe-west8",
        "europe-west9",
        "europe-west12",
        "me-central1",
        "me-central2",
        "me-west1",
        "northamerica-northeast1",
        "northamerica-northeast2",
        "southamerica-east1",
        "southamerica-west1",
        "us-central1",
        "us-east1",
        "us-east4",
        "us-east5",
        "us-south1",
        "us-west1",
        "us-west2",
        "us-west3",
        "us-west4",
    }
)
"""Regions where Vertex AI runs custom training jobs."""

ACCELERATORS = {
    "L4 24GB": "NVIDIA_L4",
    "A100 40GB": "NVIDIA_TESLA_A100",
    "A100 80GB": "NVIDIA_A100_80GB",
    "H100 80GB": "NVIDIA_H100_80GB",
    "H100 Mega 80GB": "NVIDIA_H100_MEGA_80GB",
    "H200 141GB": "NVIDIA_H200_141GB",
    "B200 180GB": "NVIDIA_B200",
}
"""Catalog GPU model -> Vertex accelerator type."""

MACHINE_FAMILIES = {
    "g2-standard": "NVIDIA_L4",
    "a2-highgpu": "NVIDIA_TESLA_A100",
    "a2-ultragpu": "NVIDIA_A100_80GB",
    "a3-highgpu": "NVIDIA_H100_80GB",
    "a3-edgegpu": "NVIDIA_H100_80GB",
    "a3-megagpu": "NVIDIA_H100_MEGA_80GB",
    "a3-ultragpu": "NVIDIA_H200_141GB",
    "a4-highgpu": "NVIDIA_B200",
}
"""GPU machine family -> the only accelerator it comes with."""

STRATEGIES = {"on-demand": "STANDARD", "spot": "SPOT", "flex-start": "FLEX_START"}
"""Provisioning -> Vertex scheduling strategy."""


def vertex_machine(quote: Quote) -> tuple[str, str]:
    """(machine type, accelerator type) for the quoted catalog row."""
    row = quote.row
    if row.cloud != "gcp":
        raise LaunchConfigError(
            "vertex", f"instance_type: {row.key} is not a GCP machine type (use gcp:<machine-type>)"
        )
    accelerator = ACCELERATORS.get(row.gpu_model)
    family = MACHINE_FAMILIES.get(row.instance_type.rsplit("-", 1)[0])
    if accelerator is None or family is None or row.gpus < 1:
        raise LaunchConfigError(
            "vertex",
            f"instance_type: {row.key} ({row.gpu_model or 'no GPU'}) is not a GPU machine "
            f"type Vertex AI offers here; known families: {', '.join(MACHINE_FAMILIES)}",
        )
    if family != accelerator:
        raise LaunchConfigError(
            "vertex",
            f"instance_type: {row.key} comes with {family}, but its catalog row says "
            f"{row.gpu_model}",
        )
    return row.instance_type, accelerator
