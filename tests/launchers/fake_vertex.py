"""A local stand-in for the Vertex AI CustomJob REST API (v1), for tests.

It speaks the JSON the real service speaks: camelCase proto JSON, RFC 3339 times, durations
such as `"3600s"`, int64 as strings, and enums as names or, when the client asks with
`$alt=json;enum-encoding=int` (the Python client always does), as numbers. It serves
`projects/{p}/locations/{l}/customJobs`: create, get, `:cancel` and list (with a
`labels.KEY="VALUE"` filter).

Each created job follows the `Script` set on the server at the time: seconds QUEUED (waiting
for capacity), seconds PENDING (provisioning), seconds RUNNING, and the final state. State is
derived from the clock at every read, the way the real service reports it:

- a FLEX_START job that would wait longer than its `maxWaitDuration` (default 1 day, 0 = wait
  forever) fails when the wait runs out, never having started, with RESOURCE_EXHAUSTED;
- a job that would run past `scheduling.timeout` fails at start + timeout with
  DEADLINE_EXCEEDED;
- `:cancel` moves a job through CANCELLING to CANCELLED with error CANCELLED, and a job
  cancelled before it started has no `startTime`;
- like the real service, the first worker pool is the primary replica: its `replicaCount`
  must be 1; machine types and accelerators are checked against what the server "offers".
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tests.support.gcp_server import ApiError, JsonServer

STATES = {
    "JOB_STATE_QUEUED": 1,
    "JOB_STATE_PENDING": 2,
    "JOB_STATE_RUNNING": 3,
    "JOB_STATE_SUCCEEDED": 4,
    "JOB_STATE_FAILED": 5,
    "JOB_STATE_CANCELLING": 6,
    "JOB_STATE_CANCELLED": 7,
}
STRATEGIES = {0: "STRATEGY_UNSPECIFIED", 3: "STANDARD", 4: "SPOT", 6: "FLEX_START"}
ACCELERATORS = {
    8: "NVIDIA_TESLA_A100",
    9: "NVIDIA_A100_80GB",
    11: "NVIDIA_L4",
    13: "NVIDIA_H100_80GB",
    14: "NVIDIA_H100_MEGA_80GB",
    15: "NVIDIA_H200_141GB",
    16: "NVIDIA_B200",
}
OFFERS = {
    "g2-standard-4": ("NVIDIA_L4", 1),
    "a2-highgpu-1g": ("NVIDIA_TESLA_A100", 1),
    "a3-highgpu-8g": ("NVIDIA_H100_80GB", 8),
    "a3-ultragpu-8g": ("NVIDIA_H200_141GB", 8),
}
"""Machine type -> the accelerator and count it comes with."""
DEFAULT_MAX_WAIT_S = 86400.0
CANCEL_S = 0.15
"""How long CANCELLING lasts."""
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED = 8, 4, 1
WAIT_EXPIRED_MESSAGE = (
    "Job failed to start: the requested resources were not available within the "
    "scheduling.maxWaitDuration of {wait}."
)


def enum_name(table: dict[int, str], value: int | str) -> str:
    """An enum as its name, whether the JSON carried the name or the number."""
    return table[value] if isinstance(value, int) else value


def duration_s(text: str | None, default: float) -> float:
    return default if text is None else float(text.rstrip("s"))


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Script:
    queued_s: float = 0.0
    pending_s: float = 0.0
    run_s: float = 0.5
    final: str = "JOB_STATE_SUCCEEDED"
    error: str = "The replica workerpool0-0 exited with a non-zero status of 1."
    """The error message when `final` is JOB_STATE_FAILED."""
    error_code: int = 3
    """Its google.rpc code: INVALID_ARGUMENT for the job's own failure, as Vertex gives it;
    RESOURCE_EXHAUSTED (a STOCKOUT) plays a Spot VM taken back."""
    honor_timeout: bool = True
    """False: a job that overruns `scheduling.timeout` (to test the launcher's backstop)."""


@dataclass
class Job:
    name: str
    body: dict
    script: Script
    created: float
    cancel_at: float | None = None
    reads: int = 0

    @property
    def scheduling(self) -> dict:
        return self.body["jobSpec"].get("scheduling", {})

    @property
    def strategy(self) -> str:
        return enum_name(STRATEGIES, self.scheduling.get("strategy", 0))

    @property
    def max_wait(self) -> float:
        """How long it may wait for capacity: FLEX_START only; 0 means forever."""
        if self.strategy != "FLEX_START":
            return math.inf
        wait = duration_s(self.scheduling.get("maxWaitDuration"), DEFAULT_MAX_WAIT_S)
        return math.inf if wait == 0 else wait

    @property
    def timeout(self) -> float:
        return duration_s(self.scheduling.get("timeout"), 7 * 86400.0)

    def start(self) -> float | None:
        """When all replicas run (None if the wait runs out or a cancel comes first)."""
        wait = self.script.queued_s + self.script.pending_s
        start = self.created + wait
        if wait > self.max_wait or (self.cancel_at is not None and self.cancel_at < start):
            return None
        return start

    def end(self) -> tuple[float, str, dict | None]:
        """When and how the job ends (it may lie in the future)."""
        start = self.start()
        ends = []
        if start is None and self.max_wait < math.inf:
            wait = f"{self.max_wait:g}s"
            error = {"code": RESOURCE_EXHAUSTED, "message": WAIT_EXPIRED_MESSAGE.format(wait=wait)}
            ends.append((self.created + self.max_wait, "JOB_STATE_FAILED", error))
        if start is not None:
            if self.script.honor_timeout and self.script.run_s > self.timeout:
                message = f"Job exceeded its timeout of {self.timeout:g}s and was stopped."
                error = {"code": DEADLINE_EXCEEDED, "message": message}
                ends.append((start + self.timeout, "JOB_STATE_FAILED", error))
            else:
                failed = self.script.final == "JOB_STATE_FAILED"
                code, message = self.script.error_code, self.script.error
                error = {"code": code, "message": message} if failed else None
                ends.append((start + self.script.run_s, self.script.final, error))
        if self.cancel_at is not None:
            error = {"code": CANCELLED, "message": "CANCELED"}
            ends.append((self.cancel_at + CANCEL_S, "JOB_STATE_CANCELLED", error))
        return min(ends, key=lambda e: e[0]) if ends else (math.inf, "", None)

    def view(self, now: float, int_enums: bool) -> dict[str, Any]:
        start, (end, final, error) = self.start(), self.end()
        if now >= end:
            state = final
        elif self.cancel_at is not None and now >= self.cancel_at:
            state = "JOB_STATE_CANCELLING"
        elif start is not None and now >= start:
            state = "JOB_STATE_RUNNING"
        elif now >= self.created + self.script.queued_s:
            state = "JOB_STATE_PENDING"
        else:
            state = "JOB_STATE_QUEUED"
        out: dict[str, Any] = {
            "name": self.name,
            "displayName": self.body.get("displayName", ""),
            "jobSpec": self.body["jobSpec"],
            "state": STATES[state] if int_enums else state,
            "createTime": rfc3339(self.created),
            "updateTime": rfc3339(min(now, end)),
            "labels": self.body.get("labels", {}),
        }
        if start is not None and min(now, end) >= start:
            out["startTime"] = rfc3339(start)
        if now >= end:
            out["endTime"] = rfc3339(end)
            if error:
                out["error"] = error
        return out


@dataclass
class FakeVertex(JsonServer):
    """The Vertex AI job service of one project, all regions."""

    project: str = "demo-project"
    project_number: str = "123456789012"
    public_key: str | None = None
    script: Script = field(default_factory=Script)
    """What the next created jobs do."""
    scripts: list[Script] = field(default_factory=list)
    """What the next few created jobs do, one each, in order, before `script` again."""
    fail_create_after_commit: bool = False
    """Create the next job but answer 503, as a request lost on its way back would."""

    def __post_init__(self) -> None:
        super().__init__(self.public_key)
        self.jobs: dict[str, Job] = {}
        self.created: list[dict] = []
        """Every create request body, as sent."""
        self.cancelled: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._ids = itertools.count(4_000_000_000_000_000_001)

    def job(self, index: int = -1) -> Job:
        return list(self.jobs.values())[index]

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], body: dict
    ) -> tuple[int, dict]:
        self.calls.append((method, path))
        int_enums = "enum-encoding=int" in ";".join(query.get("$alt", []))
        now = time.time()
        parts = path.removeprefix("/v1/").split("/")
        if len(parts) < 5 or parts[0] != "projects" or parts[2] != "locations":
            raise ApiError(404, f"The requested URL {path} was not found on this server.")
        if parts[1] not in (self.project, self.project_number):
            raise ApiError(
                403, f"Permission 'aiplatform.customJobs.list' denied on 'projects/{parts[1]}'"
            )
        location, rest = parts[3], parts[4:]
        if rest == ["customJobs"] and method == "POST":
            return 200, self._create(location, body, now).view(now, int_enums)
        if rest == ["customJobs"] and method == "GET":
            jobs = [j for j in self.jobs.values() if self._matches(j, query.get("filter", [""])[0])]
            size = int(query.get("pageSize", ["100"])[0])
            return 200, {"customJobs": [j.view(now, int_enums) for j in jobs[:size]]}
        if len(rest) == 2 and rest[0] == "customJobs":
            job_id, _, verb = rest[1].partition(":")
            job = self.jobs.get(job_id)
            if job is None:
                raise ApiError(404, f"CustomJob {job_id} is not found.")
            if method == "GET" and not verb:
                job.reads += 1
                return 200, job.view(now, int_enums)
            if method == "POST" and verb == "cancel":
                if now >= job.end()[0]:
                    raise ApiError(400, f"Cannot cancel CustomJob {job_id}: it has ended.")
                self.cancelled.append(job.name)
                if job.cancel_at is None:
                    job.cancel_at = now
                return 200, {}
        raise ApiError(404, f"The requested URL {path} was not found on this server.")

    @staticmethod
    def _matches(job: Job, expression: str) -> bool:
        if not expression:
            return True
        key, _, value = expression.partition("=")
        return job.body.get("labels", {}).get(key.removeprefix("labels.")) == value.strip('"')

    def _create(self, location: str, body: dict, now: float) -> Job:
        pools = body.get("jobSpec", {}).get("workerPoolSpecs") or []
        if not pools:
            raise ApiError(400, "CustomJobSpec.worker_pool_specs is required.")
        if int(pools[0].get("replicaCount", 0)) != 1:
            raise ApiError(400, "The primary worker pool (worker_pool_specs[0]) needs 1 replica.")
        for i, pool in enumerate(pools):
            machine = pool.get("machineSpec", {})
            offer = OFFERS.get(machine.get("machineType"))
            accelerator = enum_name(ACCELERATORS, machine.get("acceleratorType", 0))
            if offer != (accelerator, machine.get("acceleratorCount")):
                raise ApiError(
                    400,
                    f"worker_pool_specs[{i}]: machine type {machine.get('machineType')} with "
                    f"{machine.get('acceleratorCount')} x {accelerator} is not supported.",
                )
            if not pool.get("containerSpec", {}).get("imageUri"):
                raise ApiError(400, f"worker_pool_specs[{i}].container_spec.image_uri is required.")
        self.created.append(body)
        job_id = str(next(self._ids))
        name = f"projects/{self.project_number}/locations/{location}/customJobs/{job_id}"
        job = Job(name, body, self.scripts.pop(0) if self.scripts else self.script, now)
        self.jobs[job_id] = job
        if self.fail_create_after_commit:
            self.fail_create_after_commit = False
            raise ApiError(503, "The service is currently unavailable.")
        return job
