"""The local launcher: a job is the whole process tree it starts, and its clock is its own.

Background children (`nohup`, `setsid`) are real processes here, found afterwards by a marker
in their environment; ledger stalls are real locks held from another connection, on SQLite
and PostgreSQL. Timing bounds are generous: the test machine is small and busy.
"""

from __future__ import annotations

import shlex
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import Ledger, normalise_url
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher, marked_processes
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.conftest import _fresh_pg

SLACK_S = 5.0
"""What a busy 2-core machine may add to any bound here."""


def _tree_job(script: str, **kw) -> tuple[GpuJob, str]:
    """A job running `script` in sh, every process of it marked with a fresh TEST_TREE."""
    mark = uuid.uuid4().hex
    job = GpuJob(
        instance_type="local:box",
        command=["sh", "-c", script],
        env={"TEST_TREE": mark},
        **kw,
    )
    return job, mark


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries TEST_TREE=mark."""
    return marked_processes("TEST_TREE", mark)


class _Lifetime:
    """Watches, from outside, how long any process of a marked tree is alive."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self.first: float | None = None
        self.last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if _marked(self.mark):
                now = time.time()
                self.first = self.first or now
                self.last = now
            time.sleep(0.1)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        assert self.first is not None and self.last is not None, "the job never ran"
        return self.last - self.first


@pytest.fixture
def quote(prices: Path):
    return Catalog.load(prices).quote("local:box", 1, "on-demand")


def test_background_children_are_part_of_the_job(quote):
    """`nohup` and `setsid` children of a command that exits at once: the job lasts until the
    last of them ends, and nothing of it is left running afterwards."""
    job, mark = _tree_job(
        "nohup sleep 3 >/dev/null 2>&1 & setsid sleep 4 >/dev/null 2>&1 & echo launched",
        max_runtime="1m",
        kill_grace="1s",
    )
    lines: list[str] = []
    result = LocalLauncher().run(job, quote, log=lines.append)
    assert result.outcome == "completed" and result.exit_code == 0, result
    assert "launched" in lines
    assert 3.5 <= result.runtime_s < 4 + SLACK_S, result.runtime_s  # the children's life
    assert _marked(mark) == []


def test_children_outliving_max_runtime_are_killed_at_max_runtime(quote):
    """Escaped children (one ignoring SIGTERM) are stopped at max_runtime with the job."""
    job, mark = _tree_job(
        "nohup sleep 60 >/dev/null 2>&1 &"
        " setsid sleep 60 >/dev/null 2>&1 &"
        " setsid sh -c 'trap \"\" TERM; sleep 60' >/dev/null 2>&1 &"
        " exit 0",
        max_runtime="2s",
        kill_grace="1s",
    )
    watch = _Lifetime(mark)
    result = LocalLauncher().run(job, quote, log=lambda line: None)
    lived = watch.stop()
    assert result.outcome == "timed_out", result
    assert 2.0 <= result.runtime_s < 2 + 1 + SLACK_S, result.runtime_s
    assert lived < 2 + 1 + SLACK_S, lived
    assert _marked(mark) == []
    # killed at its bound, billed at most its bound: never the kill's latency past the
    # reservation (max_runtime + kill grace)
    assert result.billed_seconds is not None
    assert result.billed_seconds <= job.reserve_runtime_s == 3.0
    assert result.billed_seconds == min(result.runtime_s, 3.0)


@pytest.mark.parametrize("child", [False, True], ids=["the job", "its child"])
def test_max_runtime_signals_each_process_once_before_its_grace(quote, child):
    """One SIGTERM per process, as Slurm sends at a time limit before KillWait: a job that
    checkpoints on the first and aborts on a second must get only the first."""
    handler = (
        "import os, signal, sys, time\n"
        "def term(*_):\n"
        "    print(f'TERM {os.getpid()}', flush=True)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "print('ready', flush=True)\n"
        "deadline = time.time() + 30\n"
        "while time.time() < deadline: time.sleep(0.05)\n"
    )
    command = [sys.executable, "-c", handler]
    if child:  # the handler runs in a child of a shell that waits for it
        command = ["sh", "-c", f"{shlex.join(command)}; true"]
    job = GpuJob(instance_type="local:box", command=command, max_runtime="2s", kill_grace="2s")
    lines: list[str] = []
    result = LocalLauncher().run(job, quote, log=lines.append)
    assert result.outcome == "timed_out", result
    terms = [line for line in lines if line.startswith("TERM ")]
    assert len(terms) == 1, lines


def test_exit_code_output_and_environment_pass_through(quote, tmp_path):
    job, mark = _tree_job(
        'echo "mark=$TEST_TREE metrics=$GPU_BUDGET_METRICS_FILE"; exit 3', max_runtime="1m"
    )
    lines: list[str] = []
    result = LocalLauncher().run(
        job, quote, log=lines.append, env={"GPU_BUDGET_METRICS_FILE": str(tmp_path / "m")}
    )
    assert result.outcome == "failed" and result.exit_code == 3 and "exit code 3" in result.detail
    assert f"mark={mark} metrics={tmp_path / 'm'}" in lines


def test_a_missing_program_is_a_launch_error(quote):
    job = GpuJob(instance_type="local:box", command=["no-such-program-here"], max_runtime="1m")
    result = LocalLauncher().run(job, quote, log=lambda line: None)
    assert result.outcome == "launch_error" and "no-such-program-here" in result.detail


def test_stop_by_external_id_stops_the_whole_tree(quote):
    """Reconcile and preemption stop a job by its id: escaped children go with it."""
    job, mark = _tree_job(
        "setsid sleep 60 >/dev/null 2>&1 & nohup sleep 60 >/dev/null 2>&1 & sleep 60",
        max_runtime="1m",
        kill_grace="1s",
    )
    launcher, ids, results = LocalLauncher(), [], []
    runner = threading.Thread(
        target=lambda: results.append(
            launcher.run(job, quote, log=lambda line: None, on_start=lambda s, i: ids.append(i))
        )
    )
    runner.start()
    deadline = time.time() + 30
    while not (ids and len(_marked(mark)) >= 3) and time.time() < deadline:  # sh, 2 children
        time.sleep(0.1)
    assert ids and launcher.probe(ids[0]).state == "running"
    launcher.stop(ids[0], grace=1.0)
    runner.join(timeout=30)
    assert results and results[0].runtime_s < 60
    assert _marked(mark) == []


HOLDER_SCRIPT = """
import sys
from pathlib import Path
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.pricing.catalog import Catalog

quote = Catalog.load(Path(sys.argv[1])).quote("local:box", 1, "on-demand")
job = GpuJob(
    instance_type="local:box",
    command=["sh", "-c", "setsid sleep 60 >/dev/null 2>&1 & nohup sleep 60 >/dev/null 2>&1 & sleep 60"],
    env={"TEST_TREE": sys.argv[2]},
    max_runtime="5m",
)
LocalLauncher().run(job, quote, log=lambda line: None)
"""


def test_the_whole_tree_dies_with_the_process_that_launched_it(prices):
    """The launching process is SIGKILLed (no cleanup runs): the job's tree, escaped children
    included, goes with it rather than running on unmetered."""
    mark = uuid.uuid4().hex
    launching = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, str(prices), mark])
    try:
        deadline = time.time() + 60
        while len(_marked(mark)) < 4 and time.time() < deadline:  # holder, sh, two children
            time.sleep(0.1)
        assert len(_marked(mark)) >= 4, "the job never started"
    finally:
        launching.kill()
        launching.wait()
    deadline = time.time() + 15
    while _marked(mark) and time.time() < deadline:
        time.sleep(0.1)
    assert _marked(mark) == []


# -- a ledger stall when the job starts --------------------------------------------------------


@pytest.fixture
def pg_url() -> str:
    """This run's PostgreSQL ledger database, its tables dropped (see tests/support/postgres.py)."""
    return _fresh_pg()


@pytest.fixture(params=["sqlite", "postgresql"])
def stall_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_url")


def _hold_lock(url: str, seconds: float, held: threading.Event) -> None:
    """Lock the jobs table against writers from a connection of its own for `seconds`."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.split("///", 1)[1], isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
        conn.close()
        return
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE gpu_jobs IN EXCLUSIVE MODE"))
            held.set()
            time.sleep(seconds)
    finally:
        engine.dispose()


def test_a_ledger_stall_at_start_does_not_stretch_the_run(stall_url, prices):
    """The ledger is locked from another connection for longer than max_runtime plus grace
    while the job starts: the job is still stopped in time, and billed what it ran, at most
    its reservation, once the ledger is back."""
    from prefect_gpu_budget.admission.lifecycle import run_admitted

    ledger = Ledger(normalise_url(stall_url))
    try:
        ledger.config.set_budget(
            BudgetRule("stall", hourly_cap_cents=1000, period_budget_micro=10**7)
        )
        gate = Gate(ledger, catalog=Catalog.load(prices))
        job, mark = _tree_job("sleep 60", max_runtime="3s", kill_grace="2s")
        admission = gate.admit(job, "stall/s")
        hold_s = 15.0  # > max_runtime + kill_grace + SLACK_S: a stretched run shows
        held = threading.Event()
        locker = threading.Thread(target=_hold_lock, args=(stall_url, hold_s, held))
        locker.start()
        assert held.wait(30)
        watch = _Lifetime(mark)
        ended = run_admitted(gate, admission, LocalLauncher())
        result, row = ended.result, ended.row
        lived = watch.stop()
        locker.join()
        assert lived < 3 + 2 + SLACK_S, lived
        assert result.runtime_s < 3 + 2 + SLACK_S, result
        assert result.outcome == "cancelled" and "could not be recorded" in result.detail
        assert row["state"] == "settled" and row["started_at"] is not None
        assert 0 < row["actual_micro"] <= row["reserved_micro"], row
        assert _marked(mark) == []
    finally:
        ledger.db.dispose()


def test_a_short_stall_within_the_kill_grace_lets_the_job_run(prices, tmp_path):
    from prefect_gpu_budget.admission.lifecycle import run_admitted

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    try:
        ledger.config.set_budget(BudgetRule("short", hourly_cap_cents=1000))
        gate = Gate(ledger, catalog=Catalog.load(prices))
        job = GpuJob(
            instance_type="local:box",
            command=[sys.executable, "-c", "import time; time.sleep(3)"],
            max_runtime="1m",
            kill_grace="10s",
        )
        admission = gate.admit(job, "short/s")
        held = threading.Event()
        locker = threading.Thread(target=_hold_lock, args=(url, 1.0, held))
        locker.start()
        assert held.wait(30)
        ended = run_admitted(gate, admission, LocalLauncher())
        result, row = ended.result, ended.row
        locker.join()
        assert result.outcome == "completed", result
        assert row["billed_seconds"] >= 2.5
    finally:
        ledger.db.dispose()


def test_a_100_mb_line_of_output_does_not_grow_the_worker(prices):
    """The job's output is logged a bounded line at a time: the rest of a huge line is read
    in pieces and dropped, and what follows it still reaches the log."""
    import tracemalloc

    from prefect_gpu_budget.launchers.local import MAX_OUTPUT_LINE, LocalLauncher
    from prefect_gpu_budget.pricing.catalog import Catalog

    job = GpuJob(
        instance_type="local:box",
        max_runtime="2m",
        command=[
            sys.executable,
            "-c",
            "import sys; sys.stdout.write('x' * 100_000_000 + '\\nafter\\n')",
        ],
    )
    quote = Catalog.load(prices).quote("local:box")
    lines: list[str] = []
    tracemalloc.start()
    try:
        result = LocalLauncher().run(job, quote, log=lines.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.outcome == "completed", result
    assert lines[-1] == "after" and len(lines) == 2, [line[:40] for line in lines]
    assert lines[0].endswith(f"[line cut at {MAX_OUTPUT_LINE} chars]")
    assert peak < 16 << 20, f"peak {peak / 2**20:.0f} MiB while reading a 100 MB line"
