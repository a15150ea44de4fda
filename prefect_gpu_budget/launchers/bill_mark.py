"""The mark that matches a cloud's bill to the ledger: every cloud job a launcher starts carries
its ledger job id under the key `gpu-budget-job` (`BILL_MARK`), set when it is launched.

- SageMaker: a tag on the training job (`CreateTrainingJob`'s `Tags`); once the key is activated
  as a cost allocation tag it reaches CUR 2.0's `resource_tags`. The training job's name (the
  job's external id) stays the fallback key.
- Vertex AI: a label on the custom job, beside `managed-by` and the launch label; labels reach
  the Cloud Billing export's `labels`.
- A deployment's flow run: the `labels` job variable, where its work pool's base job template
  declares one (the default templates of the process, ECS, Vertex AI, Cloud Run and Kubernetes
  worker types do, and those workers put them on what they create: ECS task tags, Vertex AI and
  Cloud Run labels, Kubernetes labels); and the flow run tag `gpu-budget-job:<id>`.

The bill readers (`billing/`) look for the same key. The id reaches a launcher in its `env` as
`GPU_BUDGET_JOB_ID` (`settings.JOB_ID_ENV`), which `lifecycle.run_admitted` sets for every job it
runs: every launcher keeps its signature, and the job's own process learns which ledger row it
is. A launcher run without it (called directly, not through the gate) sets no mark. A value a
cloud would refuse (only an env set by hand can hold one) fails the launch, in one line, before
anything is created.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from prefect_gpu_budget.billing.lines import JOB_MARK
from prefect_gpu_budget.settings import JOB_ID_ENV
from prefect_gpu_budget.units import shown

BILL_MARK = JOB_MARK
"""The tag or label key every cloud job carries: its ledger job id (the bill readers' own)."""
SAGEMAKER_TAG_MAX = 256
SAGEMAKER_TAG_SYMBOLS = frozenset("_.:/=+-@")
"""What a SageMaker tag value may hold besides letters, separators and numbers."""
GCP_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
"""A GCP label value: lowercase letters, digits, `_` and `-`, at most 63 characters."""


def ledger_job_id(env: Mapping[str, str] | None) -> str | None:
    """The ledger job id a launcher was handed in `env` (`GPU_BUDGET_JOB_ID`); None without."""
    return (env or {}).get(JOB_ID_ENV) or None


def sagemaker_tag_problem(value: str | None) -> str | None:
    """Why SageMaker would refuse `value` for the mark's tag (its rule: at most 256 characters
    of `[\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]`); None when it would take it, or there is none."""
    if value is None:
        return None
    if len(value) > SAGEMAKER_TAG_MAX:
        return f"{JOB_ID_ENV} is longer than a SageMaker tag value's {SAGEMAKER_TAG_MAX} characters"
    for char in value:
        if char not in SAGEMAKER_TAG_SYMBOLS and unicodedata.category(char)[0] not in "LZN":
            return f"{JOB_ID_ENV} {shown(value)} holds {char!r}, which a SageMaker tag cannot"
    return None


def gcp_label_problem(value: str | None) -> str | None:
    """Why GCP would refuse `value` for the mark's label; None when it would take it, or there
    is none."""
    if value is None or GCP_LABEL_VALUE.fullmatch(value):
        return None
    return (
        f"{JOB_ID_ENV} {shown(value)} is not a GCP label value (lowercase letters, digits, "
        "_ and -, at most 63 characters)"
    )


def flow_run_tag(job_id: str) -> str:
    """The Prefect flow run tag that shows the mark in the UI."""
    return f"{BILL_MARK}:{job_id}"


def pool_labels(
    job_id: str, base_job_template: Mapping[str, Any], *layers: Mapping[str, Any] | None
) -> dict[str, str] | None:
    """The `labels` job variable that marks a flow run's infrastructure with `job_id`, or None
    when the work pool's base job template declares no `labels` variable (one it does not
    declare is refused by the server or ignored by the worker).

    Prefect replaces a deployment's `labels` with a flow run's (only `env` is merged), so the
    labels already set are kept under the mark: the template's default, then each of `layers`'
    `labels` in turn (the deployment's job variables, the launcher's)."""
    variables = base_job_template.get("variables") or {}
    declared = variables.get("properties") or {}
    if "labels" not in declared:
        return None
    labels: dict[str, str] = dict(declared["labels"].get("default") or {})
    for layer in layers:
        labels.update((layer or {}).get("labels") or {})
    labels[BILL_MARK] = job_id
    return labels
