"""A loopback AWS endpoint for tests: moto in server mode, plus the parts moto 5.2 lacks.

What moto 5.2.5 does not do, and what this module adds on top of its server:

- SageMaker training jobs are `Completed` the moment CreateTrainingJob returns (no `InProgress`,
  TrainingStartTime == TrainingEndTime == CreationTime), have no BillableTimeInSeconds or
  TrainingTimeInSeconds, drop `Environment`, ignore MaxRuntimeInSeconds, and StopTrainingJob is
  not implemented. Here a job walks Starting -> Downloading -> Training -> Uploading -> Completed,
  paced by moto's own state manager (model `sagemaker::training_job`, set through the server's
  `/moto-api/state-manager/set-transition` endpoint), can be stopped, is stopped at
  MaxRuntimeInSeconds (and MaxWaitTimeInSeconds), and reports its billable seconds.
- EC2 DescribeSpotPriceHistory answers a constant 0.00001 dated 2006 for every type. Here a region
  can be seeded with a real-looking history.
- The Price List API (`pricing`) does not exist. Here a stand-in answers
  `AWSPriceListService.GetProducts` in the AWS JSON 1.1 protocol, with `PriceList` entries as the
  JSON strings AWS sends.

Everything is reached over HTTP by the real boto3 clients through `endpoint_url`.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

from moto.core.responses import ActionResult
from moto.core.utils import utcnow
from moto.ec2.responses.spot_instances import SpotInstances
from moto.moto_api import state_manager
from moto.moto_api._internal.managed_state_model import ManagedState
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.sagemaker.exceptions import ResourceInUseException, ResourceNotFound, ValidationError
from moto.sagemaker.models import FakeTrainingJob
from moto.sagemaker.responses import SageMakerResponse
from werkzeug.serving import make_server

TRAINING_MODEL = "sagemaker::training_job"
"""The state-manager model name that paces training jobs."""

_STEPS = [
    ("Starting", "Downloading"),
    ("Downloading", "Training"),
    ("Training", "Uploading"),
    ("Uploading", "Completed"),
    ("Stopping", "Stopped"),
]
_SHOWN = {  # internal step -> (TrainingJobStatus, SecondaryStatus)
    "Starting": ("InProgress", "Starting"),
    "Downloading": ("InProgress", "Downloading"),
    "Training": ("InProgress", "Training"),
    "Uploading": ("InProgress", "Uploading"),
    "Completed": ("Completed", "Completed"),
    "Stopping": ("Stopping", "Stopping"),
    "Stopped": ("Stopped", "Stopped"),
    "MaxRuntimeExceeded": ("Stopped", "MaxRuntimeExceeded"),
    "MaxWaitTimeExceeded": ("Stopped", "MaxWaitTimeExceeded"),
    "Failed": ("Failed", "Failed"),
    "Interrupted": ("InProgress", "Interrupted"),
}
_ON_INSTANCES = ("Downloading", "Training", "Uploading")
"""Steps in which the instances run: TrainingStartTime is stamped on entering the first."""
REGION_PREFIX = {"us-east-1": "USE1", "us-east-2": "USE2", "us-west-2": "USW2", "eu-west-1": "EU"}
"""Usage-type prefixes the Price List uses for the regions these tests price."""


@dataclass
class Behaviour:
    """How the stand-in cloud behaves; tests change it, `AwsServer.reset` restores it."""

    spot_billable_fraction: float = 0.3
    """Managed spot: BillableTimeInSeconds = ceil(TrainingTimeInSeconds x this)."""
    enforce_max_runtime: bool = True
    """False plays a cloud that fails to stop a job at MaxRuntimeInSeconds."""
    failures: dict[str, str] = field(default_factory=dict)
    """Training-job name prefix -> FailureReason: such jobs fail once they reach Training."""
    interruptions: dict[str, int] = field(default_factory=dict)
    """Training-job name prefix -> how many more such managed spot jobs lose their instances on
    reaching Training: each stays `Interrupted` (SageMaker waiting to resume it) until its
    MaxWaitTimeInSeconds ends it `MaxWaitTimeExceeded`."""
    page_size: int = 100
    """Most entries in one GetProducts or DescribeSpotPriceHistory page."""
    products: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Price List products by service code, in the Price List's own JSON shape."""
    spot_history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """EC2 spot price history by region: SpotPriceHistory entries with a datetime Timestamp."""
    stop_calls: list[str] = field(default_factory=list)
    """Training-job names StopTrainingJob was called for, in order."""


class _TrainingRun(ManagedState):
    """One training job's life, stepped by moto's state manager."""

    def __init__(self, job: FakeTrainingJob) -> None:
        super().__init__(TRAINING_MODEL, _STEPS)
        condition = job.stopping_condition or {}
        self.max_runtime = condition.get("MaxRuntimeInSeconds", 86400)
        self.max_wait = condition.get("MaxWaitTimeInSeconds")
        self.spot = bool(job.enable_managed_spot_training)
        self.started: datetime | None = None
        self.ended: datetime | None = None
        self.failure: str | None = None
        self.last_step: str | None = None
        self.transitions: list[dict[str, Any]] = []

    def stop(self) -> None:
        self.status = "Stopping"
        self._time_progressed = datetime.now()

    def fail(self, reason: str) -> None:
        self.status, self.failure = "Failed", reason


class _Extras:
    """The additions, installed into moto's classes while an `AwsServer` runs."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.behaviour = Behaviour()
        self.runs: dict[str, _TrainingRun] = {}

    # -- SageMaker training jobs ----------------------------------------------------------------

    def adopt(self, job: FakeTrainingJob) -> None:
        """Replace moto's instant `Completed` with the start of a real life."""
        with self.lock:
            self.runs[job.arn] = _TrainingRun(job)
            job.training_job_status, job.secondary_status = _SHOWN["Starting"]
            job.training_start_time = job.training_end_time = None
            job.secondary_status_transitions = []
            job.final_metric_data_list = None
            self.refresh(job)

    def refresh(self, job: FakeTrainingJob) -> None:
        """Bring a job's fields up to date: status, times, billable seconds."""
        with self.lock:
            run = self.runs.get(job.arn)
            if run is None or run.ended is not None:
                return
            now = utcnow()
            step = run.status
            if step in (*_ON_INSTANCES, "Completed") and run.started is None:
                run.started = now
            for prefix, reason in self.behaviour.failures.items():
                if step == "Training" and job.training_job_name.startswith(prefix):
                    run.fail(reason)
                    step = "Failed"
            step = self._interrupt(job, run, step)
            limit = timedelta(seconds=run.max_runtime)
            if (
                self.behaviour.enforce_max_runtime
                and run.started is not None
                and step in _ON_INSTANCES
                and now - run.started >= limit
            ):
                run.status = step = "MaxRuntimeExceeded"
                now = run.started + limit
            if run.spot and run.max_wait and step in ("Starting", "Interrupted", *_ON_INSTANCES):
                wait_limit = timedelta(seconds=run.max_wait)
                if now - job.creation_time >= wait_limit:
                    run.status = step = "MaxWaitTimeExceeded"
                    now = job.creation_time + wait_limit
            self._show(job, run, step, now)

    def _interrupt(self, job: FakeTrainingJob, run: _TrainingRun, step: str) -> str:
        """A spot job named in `Behaviour.interruptions`, reaching Training, loses its
        instances: its step becomes (and stays) `Interrupted`."""
        for prefix, left in self.behaviour.interruptions.items():
            name = job.training_job_name
            if step == "Training" and run.spot and left > 0 and name.startswith(prefix):
                self.behaviour.interruptions[prefix] = left - 1
                run.status = step = "Interrupted"
        return step

    def _show(self, job: FakeTrainingJob, run: _TrainingRun, step: str, now: datetime) -> None:
        if step != run.last_step:
            if run.transitions:
                run.transitions[-1]["EndTime"] = now
            run.transitions.append({"Status": _SHOWN[step][1], "StartTime": now})
            run.last_step = step
            job.last_modified_time = now
        job.training_job_status, job.secondary_status = _SHOWN[step]
        job.secondary_status_transitions = [dict(t) for t in run.transitions]
        job.training_start_time = run.started
        if job.training_job_status in ("Completed", "Stopped", "Failed"):
            run.ended = run.ended or now
            job.training_end_time = run.ended
            job.failure_reason = run.failure
            if run.started is not None:
                trained = max(1, math.ceil((run.ended - run.started).total_seconds()))
                fraction = self.behaviour.spot_billable_fraction if run.spot else 1.0
                job.training_time_in_seconds = trained
                job.billable_time_in_seconds = max(1, math.ceil(trained * fraction))

    def stop(self, job: FakeTrainingJob) -> None:
        with self.lock:
            self.behaviour.stop_calls.append(job.training_job_name)
            self.refresh(job)
            if job.training_job_status != "InProgress":
                raise ValidationError(
                    "The request was rejected because the training job is in status "
                    f"{job.training_job_status}."
                )
            run = self.runs[job.arn]
            run.stop()
            self._show(job, run, "Stopping", utcnow())

    # -- EC2 spot price history -----------------------------------------------------------------

    def spot_history(self, region: str, params: dict[str, Any]) -> tuple[list[dict], str | None]:
        """DescribeSpotPriceHistory over the seeded rows, as AWS answers it.

        With a StartTime, the answer holds the prices set in [StartTime, EndTime] plus, for each
        (type, zone, product), the price already in effect at StartTime; newest first.
        """
        rows = self.behaviour.spot_history[region]
        types = params.get("InstanceTypes") or []
        products = params.get("ProductDescriptions") or []
        zone = params.get("AvailabilityZone")
        start, end = _when(params.get("StartTime")), _when(params.get("EndTime"))
        picked = [
            r
            for r in rows
            if (not types or r["InstanceType"] in types)
            and (not products or r["ProductDescription"] in products)
            and (not zone or r["AvailabilityZone"] == zone)
            and (end is None or r["Timestamp"] <= end)
        ]
        if start is not None:
            in_effect: dict[tuple[str, str, str], dict] = {}
            for r in picked:
                if r["Timestamp"] <= start:
                    key = (r["InstanceType"], r["AvailabilityZone"], r["ProductDescription"])
                    if key not in in_effect or r["Timestamp"] > in_effect[key]["Timestamp"]:
                        in_effect[key] = r
            later = [r for r in picked if r["Timestamp"] > start]
            picked = later + list(in_effect.values())
        picked.sort(key=lambda r: r["Timestamp"], reverse=True)
        size = min(int(params.get("MaxResults") or 1000), self.behaviour.page_size)
        offset = int(params.get("NextToken") or 0)
        more = offset + size < len(picked)
        return picked[offset : offset + size], str(offset + size) if more else None

    # -- Price List -----------------------------------------------------------------------------

    def get_products(self, body: dict[str, Any]) -> dict[str, Any]:
        if "ServiceCode" not in body:
            raise _ApiError("InvalidParameterException", "ServiceCode is required")
        found = [
            p
            for p in self.behaviour.products.get(body["ServiceCode"], [])
            if all(_matches(p, f) for f in body.get("Filters", []))
        ]
        size = min(int(body.get("MaxResults") or 100), self.behaviour.page_size)
        offset = int(body.get("NextToken") or 0)
        answer: dict[str, Any] = {
            "FormatVersion": body.get("FormatVersion", "aws_v1"),
            "PriceList": [json.dumps(p) for p in found[offset : offset + size]],
        }
        if offset + size < len(found):
            answer["NextToken"] = str(offset + size)
        return answer


class _ApiError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _when(value: object) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).replace(tzinfo=None)


def _matches(product: dict[str, Any], flt: dict[str, str]) -> bool:
    attributes = product["product"]["attributes"]
    have = attributes.get(flt["Field"], product["product"].get(flt["Field"]))
    kind, value = flt.get("Type", "TERM_MATCH"), flt["Value"]
    if kind in ("TERM_MATCH", "EQUALS"):
        return have == value
    if kind == "CONTAINS":
        return have is not None and value in have
    if kind == "ANY_OF":
        return have in value.split(",")
    if kind == "NONE_OF":
        return have not in value.split(",")
    raise _ApiError("InvalidParameterException", f"unknown filter type {kind}")


_extras = _Extras()


def _stop_training_job(self: SageMakerResponse) -> ActionResult:
    name = self._get_param("TrainingJobName")
    job = self.sagemaker_backend.training_jobs.get(name)
    if job is None:
        raise ResourceNotFound("Requested resource not found.")
    _extras.stop(job)
    return ActionResult({})


def _response_object(job: FakeTrainingJob) -> dict[str, Any]:
    _extras.refresh(job)
    answer = {k: v for k, v in job.gen_response_object().items() if v is not None and v != [None]}
    answer["TrainingJobArn"] = answer.pop("Arn")
    return answer


class _Front:
    """WSGI: the Price List stand-in in front of moto's own application."""

    def __init__(self, moto_app: DomainDispatcherApplication) -> None:
        self.moto_app = moto_app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if not target.startswith("AWSPriceListService."):
            return self.moto_app(environ, start_response)
        status, answer = "200 OK", {}
        try:
            if "/pricing/aws4_request" not in environ.get("HTTP_AUTHORIZATION", ""):
                raise _ApiError("MissingAuthenticationTokenException", "request is not signed")
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = json.loads(environ["wsgi.input"].read(length) or b"{}")
            operation = target.split(".", 1)[1]
            if operation != "GetProducts":
                raise _ApiError("UnknownOperationException", f"{operation} is not served here")
            answer = _extras.get_products(body)
        except _ApiError as exc:
            status, answer = "400 Bad Request", {"__type": exc.code, "Message": str(exc)}
        payload = json.dumps(answer).encode()
        start_response(
            status,
            [("Content-Type", "application/x-amz-json-1.1"), ("Content-Length", str(len(payload)))],
        )
        return [payload]


def _describe_spot_price_history(self: SpotInstances) -> ActionResult:
    if self.region not in _extras.behaviour.spot_history:
        return _MOTO_SPOT_HISTORY(self)
    params = {
        name: self._get_param(name)
        for name in ("AvailabilityZone", "StartTime", "EndTime", "MaxResults", "NextToken")
    }
    params["InstanceTypes"] = self._get_param("InstanceTypes", [])
    params["ProductDescriptions"] = self._get_param("ProductDescriptions", [])
    rows, token = _extras.spot_history(self.region, params)
    answer: dict[str, Any] = {"SpotPriceHistory": rows}
    if token:
        answer["NextToken"] = token
    return ActionResult(answer)


_MOTO_SPOT_HISTORY = SpotInstances.describe_spot_price_history
_MOTO_TRAINING_INIT = FakeTrainingJob.__init__
_MOTO_CREATE_TRAINING_JOB = SageMakerResponse.create_training_job


def _training_init(job: FakeTrainingJob, *args: Any, **kwargs: Any) -> None:
    _MOTO_TRAINING_INIT(job, *args, **kwargs)
    job.environment = None
    _extras.adopt(job)


def _create_training_job(self: SageMakerResponse) -> ActionResult:
    if self._get_param("TrainingJobName") in self.sagemaker_backend.training_jobs:
        raise ResourceInUseException(
            "Training job names must be unique within an AWS account and region"
        )
    result = _MOTO_CREATE_TRAINING_JOB(self)
    job = self.sagemaker_backend.training_jobs[self._get_param("TrainingJobName")]
    job.environment = self._get_param("Environment") or None
    return result


@contextmanager
def _installed() -> Iterator[None]:
    with ExitStack() as stack:
        patches = [
            (FakeTrainingJob, "__init__", _training_init),
            (FakeTrainingJob, "response_object", property(_response_object)),
            (SageMakerResponse, "create_training_job", _create_training_job),
            (SageMakerResponse, "stop_training_job", _stop_training_job),
            (SpotInstances, "describe_spot_price_history", _describe_spot_price_history),
        ]
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value, create=True))
        state_manager.register_default_transition(TRAINING_MODEL, {"progression": "immediate"})
        yield


class AwsServer:
    """moto's server and the additions above, on 127.0.0.1 at a free port, in a thread.

    Use as a context manager; `url` is the endpoint for every boto3 client.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._thread: threading.Thread | None = None
        self.url = ""

    @property
    def behaviour(self) -> Behaviour:
        return _extras.behaviour

    def __enter__(self) -> AwsServer:
        self._stack.enter_context(_installed())
        app = _Front(DomainDispatcherApplication(create_backend_app))
        server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler)
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        self._stack.callback(self._thread.join, 10)
        self._stack.callback(server.shutdown)
        self.url = f"http://127.0.0.1:{server.server_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()
        self._stack.close()

    def reset(self) -> None:
        """Forget every resource (moto's own reset endpoint), transition and seeded answer."""
        self._post("reset", {})
        self.set_training_pace(None)
        with _extras.lock:
            _extras.runs.clear()
            _extras.behaviour = Behaviour()

    def set_training_pace(self, seconds_per_step: float | None) -> None:
        """Pace training jobs through the server's state-manager endpoint (None: the default)."""
        if seconds_per_step is None:
            path, body = "unset-transition", {"model_name": TRAINING_MODEL}
        else:
            transition = {"progression": "time", "seconds": seconds_per_step}
            path, body = "set-transition", {"model_name": TRAINING_MODEL, "transition": transition}
        self._post(f"state-manager/{path}", body)

    def _post(self, path: str, body: dict[str, Any]) -> None:
        """POST to moto's own /moto-api/ endpoints; an HTTP error raises."""
        request = urllib.request.Request(
            f"{self.url}/moto-api/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def credentials(self, region: str = "us-east-1", **fields: Any) -> Any:
        """An `AwsCredentials` block whose clients talk to this server."""
        from prefect_aws import AwsCredentials

        return AwsCredentials(
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name=region,
            aws_client_parameters={"endpoint_url": self.url},
            **fields,
        )

    def seed_spot_prices(self, region: str, rows: list[tuple[str, str, str, datetime]]) -> None:
        """Seed a region's spot history: (instance type, zone, USD per hour, timestamp) rows."""
        self.behaviour.spot_history.setdefault(region, []).extend(
            {
                "InstanceType": instance_type,
                "AvailabilityZone": zone,
                "ProductDescription": "Linux/UNIX",
                "SpotPrice": price,
                "Timestamp": when.astimezone(timezone.utc).replace(tzinfo=None),
            }
            for instance_type, zone, price, when in rows
        )

    def add_products(self, service_code: str, products: list[dict[str, Any]]) -> None:
        self.behaviour.products.setdefault(service_code, []).extend(products)


class _QuietHandler(MotoRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:  # no access log in test output
        pass


_REGION_NAMES = {
    "us-east-1": "US East (N. Virginia)",
    "us-east-2": "US East (Ohio)",
    "us-west-2": "US West (Oregon)",
    "eu-west-1": "EU (Ireland)",
}
_sku_counter = iter(range(10**6))


def _terms(sku: str, usd: str, description: str, reserved_usd: str | None) -> dict[str, Any]:
    code = "JRTCKXETXF"
    terms: dict[str, Any] = {
        "OnDemand": {
            f"{sku}.{code}": {
                "offerTermCode": code,
                "sku": sku,
                "effectiveDate": "2026-11-01T00:00:00Z",
                "priceDimensions": {
                    f"{sku}.{code}.6YS6EN2CT7": {
                        "unit": "Hrs",
                        "endRange": "Inf",
                        "description": description,
                        "appliesTo": [],
                        "rateCode": f"{sku}.{code}.6YS6EN2CT7",
                        "beginRange": "0",
                        "pricePerUnit": {"USD": usd},
                    }
                },
                "termAttributes": {},
            }
        }
    }
    if reserved_usd is not None:  # a cheaper term that a parser must not take for on-demand
        terms["Reserved"] = {
            f"{sku}.4NA7Y494T4": {
                "offerTermCode": "4NA7Y494T4",
                "sku": sku,
                "priceDimensions": {
                    f"{sku}.4NA7Y494T4.6YS6EN2CT7": {
                        "unit": "Hrs",
                        "pricePerUnit": {"USD": reserved_usd},
                        "description": "1 yr No Upfront",
                    }
                },
                "termAttributes": {"LeaseContractLength": "1yr", "PurchaseOption": "No Upfront"},
            }
        }
    return terms


def ec2_product(
    instance_type: str,
    region: str,
    usd: str,
    *,
    operating_system: str = "Linux",
    tenancy: str = "Shared",
    capacitystatus: str = "Used",
    pre_installed_sw: str = "NA",
    gpus: int = 1,
    vcpu: int = 4,
    memory_gib: int = 16,
) -> dict[str, Any]:
    """An AmazonEC2 Price List product as GetProducts returns it (before JSON encoding)."""
    sku = f"EC2SKU{next(_sku_counter):010d}"
    prefix = "" if region == "us-east-1" else f"{REGION_PREFIX[region]}-"
    return {
        "product": {
            "productFamily": "Compute Instance",
            "sku": sku,
            "attributes": {
                "instanceType": instance_type,
                "regionCode": region,
                "location": _REGION_NAMES[region],
                "locationType": "AWS Region",
                "operatingSystem": operating_system,
                "tenancy": tenancy,
                "capacitystatus": capacitystatus,
                "preInstalledSw": pre_installed_sw,
                "licenseModel": "No License required",
                "usagetype": f"{prefix}BoxUsage:{instance_type}",
                "operation": "RunInstances",
                "vcpu": str(vcpu),
                "memory": f"{memory_gib} GiB",
                "gpu": str(gpus),
                "servicecode": "AmazonEC2",
                "marketoption": "OnDemand",
            },
        },
        "serviceCode": "AmazonEC2",
        "terms": _terms(
            sku,
            usd,
            f"${usd} per On Demand {operating_system} {instance_type} Instance Hour",
            reserved_usd=str(round(float(usd) * 0.6, 4)),
        ),
        "version": "20261120000000",
        "publicationDate": "2026-11-20T00:00:00Z",
    }


def sagemaker_product(
    instance_type: str, region: str, usd: str, *, usage: str = "Train", component: str = "Training"
) -> dict[str, Any]:
    """An AmazonSageMaker Price List product (`usage` Train, Host, Notebk, ...)."""
    sku = f"SMSKU{next(_sku_counter):010d}"
    return {
        "product": {
            "productFamily": "ML Instance",
            "sku": sku,
            "attributes": {
                "instanceType": instance_type,
                "instanceName": instance_type,
                "regionCode": region,
                "location": _REGION_NAMES[region],
                "locationType": "AWS Region",
                "component": component,
                "usagetype": f"{REGION_PREFIX[region]}-{usage}:{instance_type}",
                "operation": "RunInstance",
                "servicecode": "AmazonSageMaker",
            },
        },
        "serviceCode": "AmazonSageMaker",
        "terms": _terms(sku, usd, f"${usd} per {component} {instance_type} hour", None),
        "version": "20261120000000",
        "publicationDate": "2026-11-20T00:00:00Z",
    }
