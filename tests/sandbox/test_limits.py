"""An agent job's limits that its launcher enforces (`sandbox/limits.py`): its folder's
size and its output, on real jobs as `nobody`; and the limits' parsing."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.sandbox.launcher import Sandbox
from prefect_gpu_budget.sandbox.limits import folder_bytes, parse_limits

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs a root worker")


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpu-limits-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def quote(prices: Path):
    return Catalog.load(prices).quote("local:box", 1, "on-demand")


@as_root
def test_a_job_that_fills_its_folder_past_its_disk_limit_is_stopped(base, quote):
    box = Sandbox(user="nobody", root=base / "jobs", limits={"disk": "2M"})
    job = GpuJob(
        instance_type="local:box",
        command=["sh", "-c", 'head -c 8388608 /dev/zero > "$TMPDIR/fill"; echo filled; sleep 60'],
        max_runtime="2m",
        kill_grace="1s",
    )
    lines: list[str] = []
    result = LocalLauncher(box).run(job, quote, log=lines.append)
    assert "filled" in lines, lines
    assert result.outcome == "failed", (result, lines)
    assert "past its disk limit of 2.0 MiB" in result.detail, result
    assert "PREFECT_GPU_BUDGET_AGENT_LIMIT_DISK" in result.detail
    assert result.ended_at - result.started_at < 50, result  # not its sleep's end
    assert not list((base / "jobs").glob("job-*")), "its folder outlived it"


@as_root
def test_what_a_job_prints_past_its_output_limit_is_dropped_with_one_line(base, quote):
    box = Sandbox(user="nobody", root=base / "jobs", limits={"output": "2K"})
    job = GpuJob(
        instance_type="local:box",
        command=[
            "sh",
            "-c",
            "i=0; while [ $i -lt 500 ]; do echo line-$i-$(printf %080d 0); i=$((i+1)); done",
        ],
        max_runtime="1m",
    )
    lines: list[str] = []
    result = LocalLauncher(box).run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    told = [x for x in lines if "output limit" in x]
    assert len(told) == 1 and "PREFECT_GPU_BUDGET_AGENT_LIMIT_OUTPUT" in told[0], lines[-3:]
    kept = [x for x in lines if x.startswith("line-")]
    assert 0 < len(kept) < 30 and sum(len(x) + 1 for x in kept) <= 2048, len(kept)
    assert lines[-1] == told[0]  # nothing after it


def test_folder_bytes_counts_each_file_once_and_only_an_owners_at_the_top(tmp_path: Path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "a", tmp_path / "b")  # the same file twice
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c").write_bytes(b"y" * 50_000)
    whole = folder_bytes(tmp_path)
    assert 150_000 <= whole < 250_000, whole
    assert folder_bytes(tmp_path, owner=os.geteuid()) == whole
    assert folder_bytes(tmp_path, owner=os.geteuid() + 12345) == 0


@pytest.mark.parametrize("name, value", [("disk", "lots"), ("output", "0"), ("disk", "1.5G")])
def test_a_bad_launcher_limit_is_refused_in_one_line(name: str, value: str):
    with pytest.raises(LaunchConfigError) as refused:
        parse_limits(((name, value),))
    assert f"PREFECT_GPU_BUDGET_AGENT_LIMIT_{name.upper()}" in refused.value.reason


DEEP = (
    "import os\n"
    "for _ in range(1200):\n"
    "    os.mkdir('d' * 200)\n"
    "    os.chdir('d' * 200)\n"
    "with open('f', 'wb') as f:\n"
    "    f.write(b'x' * (8 << 20))\n"
    "print('deep', flush=True)\n"
    "import time; time.sleep(60)\n"
)
"""A trial that writes 8 MiB at the bottom of 1,200 folders of 200-character names: far past
PATH_MAX, and past the depth a recursive walk (os.walk, shutil.rmtree) survives."""


@as_root
def test_a_file_at_any_depth_counts_and_goes_with_the_job(base, quote):
    box = Sandbox(user="nobody", root=base / "jobs", limits={"disk": "4M"})
    job = GpuJob(instance_type="local:box", command=["python3", "-c", DEEP], max_runtime="2m")
    lines: list[str] = []
    result = LocalLauncher(box).run(job, quote, log=lines.append)  # a result, no crash
    assert "deep" in lines, (result, lines)
    assert result.outcome == "failed" and "past its disk limit" in result.detail, result
    assert not list((base / "jobs").glob("job-*")), "its folder outlived it"


@as_root
def test_a_slow_measurement_never_holds_back_the_stop_at_max_runtime(
    base, quote, monkeypatch: pytest.MonkeyPatch
):
    """A job can make its measurement slow (millions of open files to look at): the stop at
    max_runtime comes on time all the same, the measurement running in a thread of its own."""
    from prefect_gpu_budget.sandbox.job import SandboxedJob

    monkeypatch.setattr(SandboxedJob, "held", lambda self: time.sleep(60) or 0)
    box = Sandbox(user="nobody", root=base / "jobs")
    job = GpuJob(
        instance_type="local:box", command=["sleep", "60"], max_runtime="3s", kill_grace="1s"
    )
    started = time.monotonic()
    result = LocalLauncher(box).run(job, quote)
    assert result.outcome == "timed_out", result
    assert time.monotonic() - started < 30, result
