"""The Vertex AI launcher, through the real google-cloud-aiplatform client (REST transport),
against a local stand-in of the Vertex AI CustomJob API, and a real gate on a SQLite ledger.

Credentials come from a prefect-gcp `GcpCredentials` block holding a freshly made service-account
key; the stand-in accepts only JWTs signed with that key.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest
from prefect_gcp import GcpCredentials

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import JOB_MARK
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError, Launcher, LaunchResult
from prefect_gpu_budget.launchers.bill_mark import BILL_MARK, gcp_label_problem
from prefect_gpu_budget.launchers.vertex import LAUNCH_LABEL, VertexLauncher
from prefect_gpu_budget.pricing.catalog import Catalog, PriceRow, Quote
from prefect_gpu_budget.settings import JOB_ID_ENV
from prefect_gpu_budget.units import cost_micro
from tests.launchers.fake_vertex import (
    ACCELERATORS,
    RESOURCE_EXHAUSTED,
    STRATEGIES,
    FakeVertex,
    Script,
    enum_name,
)
from tests.support.gcp_server import service_account_info, serving
from tests.support.without_extra import VERTEX_MODULES, run_without

SCOPE = "acme/vision/agent-1"
IMAGE = "us-docker.pkg.dev/demo-project/train/trainer:1"


class Interrupted(BaseException):
    """Stands in for the run being cancelled (Prefect raises a BaseException in the task)."""


@pytest.fixture(scope="module")
def key() -> tuple[dict, str]:
    return service_account_info()


@pytest.fixture
def fake(key: tuple[dict, str]) -> Iterator[FakeVertex]:
    with serving(FakeVertex(public_key=key[1])) as server:
        yield server


@pytest.fixture
def launcher(fake: FakeVertex, key: tuple[dict, str]) -> VertexLauncher:
    return VertexLauncher(
        gcp_credentials=GcpCredentials(service_account_info=key[0]),
        image_uri=IMAGE,
        api_endpoint=fake.url,
        poll_s=0.05,
    )


@pytest.fixture
def catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Catalog:
    """The shipped catalog only (no user price file)."""
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "none.csv"))
    return Catalog.load()


@pytest.fixture
def gate(tmp_path: Path, catalog: Catalog) -> Iterator[Gate]:
    ledger = Ledger(f"sqlite:///{tmp_path}/l.db")
    ledger.config.set_budget(
        BudgetRule("acme", hourly_cap_cents=50_000, period_budget_micro=50_000_000)
    )
    ledger.config.set_budget(
        BudgetRule("acme/vision")
    )  # SCOPE's team exists; the org's limits bind
    yield Gate(ledger, catalog=catalog)
    ledger.db.dispose()


def _with(launcher: VertexLauncher, **change: object) -> VertexLauncher:
    """A validated copy with some settings changed."""
    return VertexLauncher(
        **{**{k: getattr(launcher, k) for k in VertexLauncher.model_fields}, **change}
    )


def _job(**kw: object) -> GpuJob:
    fields = {"instance_type": "gcp:a2-highgpu-1g", "max_runtime": "60s", "kill_grace": "2s"}
    return GpuJob(**{**fields, **kw})


def _run_gated(
    gate: Gate, launcher: VertexLauncher, job: GpuJob, log: Callable[[str], None] | None = None
) -> tuple[Admission, LaunchResult, dict, dict, list[str]]:
    """What the GPU job task does: preflight, admit, launch, settle. Returns the admission,
    the launch result, the ledger row, the settled row and the log lines."""
    launcher.preflight(job, gate.quote(job))
    admission = gate.admit(job, SCOPE, launcher="vertex")
    lines: list[str] = []
    result = launcher.run(
        job,
        admission.quote,
        on_start=lambda started, name: gate.holding.started(admission, started, name),
        log=log or lines.append,
    )
    row = gate.holding.settle(admission, ended_at=result.ended_at, outcome=result.outcome)
    return admission, result, gate.ledger.views.job(admission.job_id), row, lines


def test_is_a_launcher(launcher: VertexLauncher) -> None:
    assert isinstance(launcher, Launcher) and launcher.kind == "vertex"


@pytest.mark.parametrize(
    ("provisioning", "max_wait", "strategy", "wire_wait", "job_wait"),
    [
        ("on-demand", None, "STANDARD", None, None),
        ("spot", None, "SPOT", None, None),
        ("flex-start", None, "FLEX_START", "86400s", None),
        ("flex-start", "0", "FLEX_START", "0s", None),
        ("flex-start", "90m", "FLEX_START", "5400s", None),
        # the job's own max_wait, as DWS's maxWaitDuration per job, when it is the shorter
        ("flex-start", None, "FLEX_START", "7200s", "2h"),
        ("flex-start", "90m", "FLEX_START", "5400s", "2h"),
        ("flex-start", "0", "FLEX_START", "600s", "10m"),
        ("flex-start", None, "FLEX_START", "86400s", "0"),
    ],
)
def test_custom_job_spec(
    fake: FakeVertex,
    launcher: VertexLauncher,
    catalog: Catalog,
    provisioning: str,
    max_wait: str | None,
    strategy: str,
    wire_wait: str | None,
    job_wait: str | None,
) -> None:
    if max_wait is not None:
        launcher = _with(launcher, capacity_max_wait=max_wait)
    fake.script = Script(run_s=0.05)
    job = _job(
        provisioning=provisioning,
        nodes=3,
        max_runtime="1h30m",
        command=["python", "train.py", "--lr=3e-4"],
        env={"SEED": "7"},
        name="sweep-lr-3e-4",
        max_wait=job_wait,
    )
    quote = catalog.quote(job.instance_type, job.nodes, job.provisioning)
    result = launcher.run(job, quote, on_start=lambda *a: None, log=lambda line: None)

    assert result.outcome == "completed"
    [body] = fake.created
    spec = body["jobSpec"]
    pools = spec["workerPoolSpecs"]
    assert [int(p["replicaCount"]) for p in pools] == [1, 2]  # the primary, then the others
    for pool in pools:
        machine = pool["machineSpec"]
        assert machine["machineType"] == "a2-highgpu-1g"
        assert enum_name(ACCELERATORS, machine["acceleratorType"]) == "NVIDIA_TESLA_A100"
        assert machine["acceleratorCount"] == quote.row.gpus
        assert pool["containerSpec"] == {
            "imageUri": IMAGE,
            "command": ["python", "train.py", "--lr=3e-4"],
            "env": [{"name": "SEED", "value": "7"}],
        }
    scheduling = spec["scheduling"]
    assert enum_name(STRATEGIES, scheduling["strategy"]) == strategy
    assert scheduling["timeout"] == "5400s"
    assert scheduling.get("maxWaitDuration") == wire_wait
    assert body["displayName"] == "sweep-lr-3e-4"
    assert body["labels"]["managed-by"] == "prefect-gpu-budget"
    assert BILL_MARK not in body["labels"]  # run without a ledger job id in its env: no mark


def test_a_gated_custom_job_is_labelled_with_its_ledger_job_id(
    fake: FakeVertex, launcher: VertexLauncher, gate: Gate
) -> None:
    """Run through the gate (`run_admitted`), the custom job carries the label
    gpu-budget-job=<ledger job id> beside its own, which the billing export's `labels` carry;
    the job's own environment gets the id too."""
    fake.script = Script(run_s=0.05)
    job = _job(env={"SEED": "7"})
    launcher.preflight(job, gate.quote(job))
    admission = gate.admit(job, SCOPE, launcher="vertex")
    ended = run_admitted(gate, admission, launcher)

    row = ended.row
    assert row["id"] == admission.job_id and row["outcome"] == "completed"
    assert row["external_id"] == fake.job().name
    [body] = fake.created
    labels = body["labels"]
    assert labels["gpu-budget-job"] == row["id"]
    assert set(labels) == {"managed-by", LAUNCH_LABEL, "gpu-budget-job"}
    assert labels["managed-by"] == "prefect-gpu-budget"
    assert BILL_MARK == JOB_MARK  # the key the bill readers look for
    [pool] = body["jobSpec"]["workerPoolSpecs"]
    assert pool["containerSpec"]["env"] == [
        {"name": "SEED", "value": "7"},
        {"name": JOB_ID_ENV, "value": row["id"]},
    ]


def test_a_job_id_gcp_would_refuse_as_a_label_is_a_launch_error(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog
) -> None:
    job = _job()
    result = launcher.run(
        job,
        catalog.quote(job.instance_type),
        on_start=lambda *a: None,
        log=print,
        env={JOB_ID_ENV: "Job-7"},
    )
    assert result.outcome == "launch_error" and result.runtime_s == 0
    assert result.detail == (
        f"{JOB_ID_ENV} 'Job-7' is not a GCP label value (lowercase letters, digits, _ and -, "
        "at most 63 characters)"
    )
    assert fake.created == [] and fake.jobs == {}


def test_gcp_label_value_rule() -> None:
    for good in ["7f1c2d3e-0000-4000-8000-000000000001", "a_b-9", "a" * 63]:
        assert gcp_label_problem(good) is None, good
    assert gcp_label_problem(None) is None
    for bad in ["A", "a.b", "a:b", "a b", "a" * 64]:
        assert gcp_label_problem(bad) is not None, bad


def test_standard_job_runs_and_settles_at_the_clouds_times(
    fake: FakeVertex, launcher: VertexLauncher, gate: Gate, key: tuple[dict, str]
) -> None:
    fake.script = Script(queued_s=0.1, pending_s=0.1, run_s=0.6)
    job = _job(instance_type="gcp:g2-standard-4")

    admission, result, row, settled, lines = _run_gated(gate, launcher, job)

    made = fake.job()
    start, (end, state, _) = made.start(), made.end()
    assert state == "JOB_STATE_SUCCEEDED" and result.outcome == "completed"
    assert result.started_at == pytest.approx(start, abs=1e-5)
    assert result.ended_at == pytest.approx(end, abs=1e-5)
    assert row["started_at"] == pytest.approx(start, abs=1e-5)
    assert row["ended_at"] == pytest.approx(end, abs=1e-5)
    assert row["external_id"] == result.external_id == made.name
    assert row["launcher"] == "vertex" and row["outcome"] == "completed"
    rate = admission.quote.rate_micro_per_hour
    assert settled["actual_micro"] == cost_micro(
        rate, row["ended_at"] - row["started_at"], round_up=False
    )
    assert result.capacity_wait_s == pytest.approx(start - made.created, abs=1e-5)
    assert any("RUNNING" in line for line in lines) and any("SUCCEEDED" in line for line in lines)
    assert set(fake.callers) == {key[0]["client_email"]}  # every call carried the block's key


def test_flex_start_waits_holding_its_reservation_then_runs(
    fake: FakeVertex, launcher: VertexLauncher, gate: Gate
) -> None:
    fake.script = Script(queued_s=0.8, pending_s=0.2, run_s=0.5)
    job = _job(provisioning="flex-start")
    seen: list[dict] = []

    def log(line: str) -> None:  # while Vertex waits for capacity, look at the ledger
        if line.startswith(("Vertex AI job QUEUED", "Vertex AI job PENDING")):
            [waiting] = [j for j in gate.ledger.views.jobs() if j["state"] != "settled"]
            seen.append(waiting)

    admission, result, row, settled, _ = _run_gated(gate, launcher, job, log=log)

    made = fake.job()
    assert result.outcome == "completed"
    assert seen and all(j["state"] == "admitted" and j["started_at"] is None for j in seen)
    assert all(j["reserved_micro"] == admission.reserved_micro > 0 for j in seen)
    assert result.capacity_wait_s == pytest.approx(made.start() - made.created, abs=1e-5)
    assert result.capacity_wait_s >= 1.0
    assert row["started_at"] == pytest.approx(made.start(), abs=1e-5)
    billed = row["ended_at"] - row["started_at"]
    assert billed == pytest.approx(0.5, abs=1e-5)  # the run only, never the wait
    rate = admission.quote.rate_micro_per_hour
    assert settled["actual_micro"] == cost_micro(rate, billed, round_up=False)


def test_flex_start_wait_runs_out(fake: FakeVertex, launcher: VertexLauncher, gate: Gate) -> None:
    launcher = _with(launcher, capacity_max_wait="1s")
    fake.script = Script(queued_s=30, run_s=1)
    job = _job(provisioning="flex-start")
    started: list[float] = []
    lines: list[str] = []

    admission = gate.admit(job, SCOPE, launcher="vertex")
    result = launcher.run(
        job, admission.quote, on_start=lambda s, n: started.append(s), log=lines.append
    )
    settled = gate.holding.settle(admission, ended_at=result.ended_at, outcome=result.outcome)

    assert fake.created[0]["jobSpec"]["scheduling"]["maxWaitDuration"] == "1s"
    assert result.outcome == "wait_expired" and not started
    assert "maxWaitDuration" in result.detail and "\n" not in result.detail
    assert result.capacity_wait_s == pytest.approx(1.0, abs=1e-5)
    assert settled["actual_micro"] == 0 and settled["billed_seconds"] == 0
    assert gate.ledger.views.job(admission.job_id)["outcome"] == "wait_expired"
    assert any("waiting for capacity" in line for line in lines)


@pytest.mark.parametrize(
    ("provisioning", "outcome"), [("spot", "interrupted"), ("on-demand", "failed")]
)
def test_a_spot_vm_taken_back_after_the_start_is_an_interruption(
    fake: FakeVertex, launcher: VertexLauncher, gate: Gate, provisioning: str, outcome: str
) -> None:
    """A started Spot job that Vertex fails with a STOCKOUT lost its VMs: `interrupted`, billed
    for what ran. The same error on an on-demand job is its failure."""
    stockout = "Spot VM preempted: the zone has no more capacity (STOCKOUT)."
    fake.script = Script(
        run_s=0.4, final="JOB_STATE_FAILED", error=stockout, error_code=RESOURCE_EXHAUSTED
    )
    admission, result, row, settled, _ = _run_gated(gate, launcher, _job(provisioning=provisioning))
    assert result.outcome == row["outcome"] == outcome
    assert result.detail == stockout
    billed = row["ended_at"] - row["started_at"]
    assert billed == pytest.approx(0.4, abs=1e-5)
    rate = admission.quote.rate_micro_per_hour
    assert 0 < settled["actual_micro"] == cost_micro(rate, billed, round_up=False)


def test_a_spot_jobs_own_failure_is_a_failure(
    fake: FakeVertex, launcher: VertexLauncher, gate: Gate
) -> None:
    fake.script = Script(run_s=0.2, final="JOB_STATE_FAILED")  # its code exited 1
    _, result, _, _, _ = _run_gated(gate, launcher, _job(provisioning="spot"))
    assert result.outcome == "failed"


def test_timeout_is_max_runtime(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog
) -> None:
    fake.script = Script(run_s=30)
    job = _job(max_runtime="1s")
    quote = catalog.quote(job.instance_type)
    result = launcher.run(job, quote, on_start=lambda *a: None, log=lambda line: None)
    assert result.outcome == "timed_out"
    assert result.runtime_s == pytest.approx(1.0, abs=1e-5)
    assert fake.cancelled == []  # Vertex stopped it itself


def test_a_job_overrunning_its_timeout_is_cancelled(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog
) -> None:
    fake.script = Script(run_s=30, honor_timeout=False)
    job = _job(max_runtime="1s", kill_grace="0.4s")
    result = launcher.run(
        job, catalog.quote(job.instance_type), on_start=lambda *a: None, log=print
    )
    assert result.outcome == "timed_out"
    assert fake.cancelled == [fake.job().name]
    assert 1.2 <= result.runtime_s < 5.0  # max_runtime + half the grace, + polling and cancel


@pytest.mark.parametrize("when", ["JOB_STATE_QUEUED", "JOB_STATE_RUNNING"])
def test_a_cancelled_run_cancels_the_custom_job(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog, when: str
) -> None:
    fake.script = Script(queued_s=1.0, run_s=30)
    job = _job(provisioning="flex-start")

    def log(line: str) -> None:
        if when.removeprefix("JOB_STATE_") in line:
            raise Interrupted

    with pytest.raises(Interrupted):
        launcher.run(
            job,
            catalog.quote(job.instance_type, 1, "flex-start"),
            on_start=lambda *a: None,
            log=log,
        )

    made = fake.job()
    assert fake.cancelled == [made.name]
    time.sleep(0.3)
    final = launcher.probe(made.name)
    assert final.state == "finished"
    assert (final.started_at is None) == (when == "JOB_STATE_QUEUED")


def test_probe_and_stop(fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog) -> None:
    fake.script = Script(run_s=60)
    job = _job()
    started = threading.Event()
    results = []
    names: list[str] = []

    def on_start(at: float, name: str) -> None:
        names.append(name)
        started.set()

    runner = threading.Thread(
        target=lambda: results.append(
            launcher.run(
                job, catalog.quote(job.instance_type), on_start=on_start, log=lambda _: None
            )
        )
    )
    runner.start()
    assert started.wait(10)
    running = launcher.probe(names[0])
    assert running.state == "running" and running.started_at == pytest.approx(fake.job().start())

    launcher.stop(names[0], grace=5)
    runner.join(10)
    [result] = results
    assert result.outcome == "cancelled" and fake.cancelled == names
    ended = launcher.probe(names[0])
    assert ended.state == "finished" and ended.ended_at == pytest.approx(result.ended_at)
    missing = names[0].rsplit("/", 1)[0] + "/1"
    assert launcher.probe(missing).state == "unknown"


def test_a_lost_create_answer_leaves_no_job_running(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog
) -> None:
    fake.fail_create_after_commit = True
    job = _job()
    result = launcher.run(
        job, catalog.quote(job.instance_type), on_start=lambda *a: None, log=print
    )
    assert result.outcome == "launch_error" and result.runtime_s == 0
    assert fake.cancelled == [fake.job().name]


def test_a_shape_vertex_refuses_is_a_launch_error(
    fake: FakeVertex, launcher: VertexLauncher
) -> None:
    row = PriceRow(
        "gcp",
        "a2-highgpu-1g",
        "on-demand",
        "A100 40GB",
        2,
        12,
        85,
        Decimal(1),
        "t",
        date.today(),
        True,
    )
    quote = Quote(row=row, nodes=1, rate_micro_per_hour=1_000_000, warnings=())
    launcher.preflight(_job(), quote)  # the shape is not ours to check: Vertex says no
    result = launcher.run(_job(), quote, on_start=lambda *a: None, log=print)
    assert result.outcome == "launch_error" and "not supported" in result.detail
    assert fake.jobs == {}


def _row(instance_type: str, gpu_model: str, cloud: str = "gcp") -> Quote:
    row = PriceRow(
        cloud,
        instance_type,
        "on-demand",
        gpu_model,
        8,
        96,
        1024,
        Decimal(1),
        "t",
        date.today(),
        True,
    )
    return Quote(row=row, nodes=1, rate_micro_per_hour=1_000_000, warnings=())


@pytest.mark.parametrize(
    ("change", "job", "quote", "field"),
    [
        ({"region": "us-moon1"}, {}, None, "region"),
        ({"image_uri": None}, {}, None, "image_uri"),
        ({}, {}, _row("n2-standard-8", ""), "instance_type"),
        ({}, {}, _row("a3-highgpu-8g", "L4 24GB"), "instance_type"),
        ({}, {}, _row("p5.48xlarge", "H100 80GB", cloud="aws"), "instance_type"),
        ({}, {"vcpu": 4}, None, "gpus: Vertex AI runs whole machines"),
        (
            {"project": "someone-elses"},
            {},
            None,
            "or project: cannot use Vertex AI in projects/someone-elses",
        ),
        ("wrong-key", {}, None, "gcp_credentials: cannot use Vertex AI"),
        ("no-project", {}, None, "project"),
    ],
)
def test_preflight_refuses_bad_settings_in_one_line(
    fake: FakeVertex,
    launcher: VertexLauncher,
    catalog: Catalog,
    change: dict | str,
    job: dict,
    quote: Quote | None,
    field: str,
) -> None:
    if change == "wrong-key":
        other, _ = service_account_info()
        change = {"gcp_credentials": GcpCredentials(service_account_info=other)}
    elif change == "no-project":
        info, _ = service_account_info(project="")
        change = {"gcp_credentials": GcpCredentials(service_account_info=info)}
    bad = _with(launcher, **change)
    gpu_job = _job(**job)
    with pytest.raises(LaunchConfigError) as refused:
        bad.preflight(
            gpu_job, quote or catalog.quote(gpu_job.instance_type, 1, gpu_job.provisioning)
        )
    message = str(refused.value)
    assert message.startswith("vertex launcher: ") and "\n" not in message
    assert field in message
    assert fake.created == [] and not any(method == "POST" for method, _ in fake.calls)


def test_preflight_passes_with_one_read(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog
) -> None:
    job = _job(provisioning="flex-start")
    launcher.preflight(job, catalog.quote(job.instance_type, 1, "flex-start"))
    assert fake.calls == [("GET", "/v1/projects/demo-project/locations/us-central1/customJobs")]


@pytest.fixture
def unreachable(key: tuple[dict, str]) -> Iterator[VertexLauncher]:
    """A launcher on a host without Vertex access: its endpoint is a local port that is bound
    but never listens, so every connection to it is refused."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield VertexLauncher(
            gcp_credentials=GcpCredentials(service_account_info=key[0]),
            image_uri=IMAGE,
            api_endpoint=f"http://127.0.0.1:{bound.getsockname()[1]}",
        )


def test_preflight_refuses_what_needs_no_network_before_it_calls_vertex(
    unreachable: VertexLauncher, catalog: Catalog
) -> None:
    job = _job(provisioning="flex-start")
    quote = catalog.quote(job.instance_type, 1, "flex-start")
    with pytest.raises(LaunchConfigError, match="region or api_endpoint: cannot use Vertex AI"):
        unreachable.preflight(job, quote)  # the network is checked, and is out of reach here
    # a job copied past the check of its own fields: 8 days, where DWS runs at most 7
    too_long = job.model_copy(update={"max_runtime": 8 * 86400.0})
    with pytest.raises(LaunchConfigError) as refused:
        unreachable.preflight(too_long, quote)
    assert str(refused.value) == (
        "vertex launcher: max_runtime: a flex-start job runs at most 7 days (Dynamic Workload "
        "Scheduler), got 691200s"
    )


def test_a_start_the_ledger_cannot_record_in_time_stops_the_job(
    fake: FakeVertex, launcher: VertexLauncher, catalog: Catalog
) -> None:
    """A stalled ledger (here: an `on_start` that takes 6 s) neither delays the job's clock nor
    lets it run unrecorded: the custom job is cancelled once its kill grace has passed."""
    fake.script = Script(run_s=30, honor_timeout=False)
    job = _job(max_runtime="10s", kill_grace="1s")
    told: list[float] = []

    def stalled(at: float, name: str) -> None:
        time.sleep(6)
        told.append(at)

    result = launcher.run(job, catalog.quote(job.instance_type), on_start=stalled, log=print)
    assert result.outcome == "cancelled", result
    assert fake.cancelled == [fake.job().name]
    assert result.runtime_s < 5.0  # cancelled at the grace, not after the stall
    assert told == [result.started_at]  # and recorded once the ledger answered


VERTEX_EXTRA = (
    "the Vertex AI launcher needs the 'vertex' extra: pip install 'prefect-gpu-budget[vertex]'"
)


def test_without_the_vertex_extra_the_block_loads_and_use_says_which_extra(
    tmp_path: Path, key: tuple[dict, str]
) -> None:
    """Without google-cloud-aiplatform the block still imports, registers and builds (`prefect
    block register -m prefect_gpu_budget` resolves it); preflight, run, probe and stop raise one
    line naming the extra, a LaunchConfigError (the job fails before anything is reserved) that
    is also an ImportError."""
    done = run_without(
        VERTEX_MODULES,
        """
        import inspect, json, os, pickle, sys
        from prefect.blocks.core import Block
        from prefect_gcp import GcpCredentials

        import prefect_gpu_budget
        from prefect_gpu_budget.job import GpuJob
        from prefect_gpu_budget.launchers import LaunchConfigError, LauncherNeedsExtra
        from prefect_gpu_budget.launchers.vertex import VertexLauncher
        from prefect_gpu_budget.pricing.catalog import Catalog

        blocks = sorted(n for n, c in inspect.getmembers(prefect_gpu_budget) if Block.is_block_class(c))
        launcher = VertexLauncher(
            gcp_credentials=GcpCredentials(service_account_info=json.loads(os.environ["KEY"])),
            image_uri="trainer:1",
        )
        job = GpuJob(instance_type="gcp:a2-highgpu-1g", max_runtime="60s")
        quote = Catalog.load().quote(job.instance_type)
        uses = {
            "preflight": lambda: launcher.preflight(job, quote),
            "run": lambda: launcher.run(job, quote, on_start=lambda *a: None, log=print),
            "probe": lambda: launcher.probe("projects/p/locations/l/customJobs/1"),
            "stop": lambda: launcher.stop("projects/p/locations/l/customJobs/1"),
        }
        errors = {}
        for use, call in uses.items():
            try:
                call()
            except LauncherNeedsExtra as exc:
                assert isinstance(exc, LaunchConfigError) and isinstance(exc, ImportError)
                again = pickle.loads(pickle.dumps(exc))
                assert type(again) is LauncherNeedsExtra and str(again) == str(exc)
                errors[use] = str(exc)
        print(json.dumps({
            "blocks": blocks,
            "errors": errors,
            "schema": sorted(VertexLauncher.model_json_schema()["properties"]),
            "imported": [m for m in sys.modules if m.startswith("google.cloud.aiplatform")],
        }))
        """,
        env={
            "PREFECT_HOME": str(tmp_path / "home"),
            "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "none.csv"),
            "KEY": json.dumps(key[0]),
        },
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "VertexLauncher" in found["blocks"] and "SageMakerLauncher" in found["blocks"]
    assert found["errors"] == dict.fromkeys(["preflight", "run", "probe", "stop"], VERTEX_EXTRA)
    assert "image_uri" in found["schema"]
    assert found["imported"] == []
