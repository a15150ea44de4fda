"""The README's and the manual's examples, run as written: the agents' admin block and whole
loop (bash, against a real Prefect server, with `serve` and `agents serve` started as the block
starts them), the Python MCP client (the MCP SDK, against that gateway), and the sweep (its spec
and `train.py`, under the Quick start's budgets and prices). `tests/test_docs.py` checks the
other blocks a reader would paste, and builds the manual.

A block is the fenced one after its marker comment (`<!-- tested: NAME ... -->`). What a test
changes: the gateway's port (a free one for 8080) and the environment (its own ledger database,
prices file, PREFECT_HOME and folders), nothing of the commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.agents.limits import STOPPED_BY_AGENT
from tests.conftest import PG_URL
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, free_port, http

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))
"""Where a marked block may live: the README (its tour) or a page of the manual."""
BASH_S = 300
"""The most a block may take, on a loaded machine: then it is stopped and the test fails."""


def block(name: str) -> tuple[str, str]:
    """The language and the text of the block marked `name`, in the README or the manual."""
    for page in PAGES:
        found = re.search(
            rf"<!-- tested: {re.escape(name)}\b[^>]*-->\n```(\w+)\n(.*?)\n```\n",
            page.read_text(),
            re.S,
        )
        if found:
            return found.group(1), found.group(2)
    raise AssertionError(f"no fenced block after <!-- tested: {name} --> in README.md or docs/")


def _bash(script: str, env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """`bash` running `script` in a process group of its own (what it starts in the background
    stays in it), its output in `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            ["bash", "-c", script],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _in_group(pgid: int, marker: bytes) -> list[int]:
    """The processes of group `pgid` whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            pid = int(entry.name) if entry.name.isdigit() else 0
            if pid and os.getpgid(pid) == pgid and marker in (entry / "cmdline").read_bytes():
                found.append(pid)
        except OSError:  # ended meanwhile
            continue
    return found


def _end_group(proc: subprocess.Popen, grace: float = 60.0) -> bool:
    """SIGTERM the block's process group (`serve` and `agents serve` stop as at Ctrl-C), the
    Prefect server the block started last (`serve` stops its sweeps through it), as the
    README says; SIGKILL what is left after `grace`. Whether it all ended by itself."""
    commands = _in_group(proc.pid, b"prefect-gpu-budget\0serve")  # serve, agents serve
    commands += _in_group(proc.pid, b"prefect-gpu-budget\0agents\0serve")
    try:
        for pid in commands:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace / 2
        while time.monotonic() < deadline and set(_in_group(proc.pid, b"")) & set(commands):
            proc.poll()
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    return False


def _of_home(home: str) -> list[str]:
    """The processes whose environment names `home` as PREFECT_HOME (any session: a server a
    command started in a session of its own included), with their command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"PREFECT_HOME={home}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()!r}")
        except OSError:  # ended meanwhile
            continue
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One real Prefect server, as the README's Quick start starts it."""
    with PrefectServer(tmp_path_factory.mktemp("readme") / "server-home") as running:
        yield running


@pytest.fixture
def house(server: PrefectServer, tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    """The environment of a reader's shell: the server's URL, a ledger of its own, a prices
    file, a PREFECT_HOME made as a new one is, where others can reach it (0755 under a
    world-readable folder, as a home folder often is: `serve` makes it private itself), and
    the package's commands first on PATH; and the ledger's URL."""
    reader = Path(tempfile.mkdtemp(prefix="gpu-budget-readme-"))
    reader.chmod(0o755)
    home = reader / ".prefect"
    home.mkdir(mode=0o755)
    with fresh_database(PG_URL) as url:
        env = server.client_env(
            PREFECT_HOME=str(home),
            PREFECT_GPU_BUDGET_LEDGER_URL=url,
            PREFECT_GPU_BUDGET_PRICES=str(tmp_path / "prices.csv"),
            PREFECT_GPU_BUDGET_AGENT_RESULTS=str(tmp_path / "agent-results"),
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        )
        try:
            yield env, url
        finally:
            shutil.rmtree(reader, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="agent jobs switch to user nobody")
def test_the_agents_blocks_run_as_written(house: tuple[dict[str, str], str], tmp_path: Path):
    """The admin's block, then the agent's whole loop in the same shell; then the MCP client
    with a token of its own, while the gateway still serves. The admin's block starts the one
    Prefect server that `serve`, the gateway and every sweep use (none starts one of its
    own), and after a SIGTERM to the shell's group nothing is left running."""
    env, url = house
    port, prefect_port = str(free_port()), str(free_port())
    languages = {}
    scripts = {}
    for name in ("agent-admin", "agent-loop", "mcp-client"):
        languages[name], text = block(name)
        assert "8080" in text, name
        scripts[name] = text.replace("8080", port).replace("4200", prefect_port)
    assert languages == {"agent-admin": "bash", "agent-loop": "bash", "mcp-client": "python"}
    admin = scripts["agent-admin"].splitlines()
    first = [n for n, line in enumerate(admin) if line.startswith("prefect-gpu-budget ")][0]
    assert any(line.startswith("prefect server start ") for line in admin[:first]), admin
    assert f"export PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api" in admin[:first], admin
    log = tmp_path / "agent.log"
    shell = _bash(scripts["agent-admin"] + "\n" + scripts["agent-loop"], env, tmp_path, log)
    try:
        try:
            shell.wait(timeout=BASH_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent blocks ran past {BASH_S}s:\n{log.read_text()[-3000:]}")
        said = log.read_text()
        assert shell.returncode == 0, said[-3000:]
        granted = subprocess.run(
            ["prefect-gpu-budget", "agent", "grant", "acme/agents/agent-8"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert granted.returncode == 0, granted.stderr
        client = subprocess.run(
            [sys.executable, "-c", scripts["mcp-client"]],
            env={**env, "GPU_BUDGET_TOKEN": granted.stdout.strip()},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        api = f"http://127.0.0.1:{prefect_port}/api"
        flows = {f["name"] for f in http(f"{api}/flows/filter", {})}
        ran = http(f"{api}/flow_runs/filter", {})
    finally:
        ended = _end_group(shell)
    left = _of_home(env["PREFECT_HOME"])

    assert ended and not left, f"left running after SIGTERM: {left}"
    assert "agent-sweep" in flows and ran, (flows, ran)  # the agent's sweep ran on that server
    assert "no PREFECT_API_URL" not in said and "database is locked" not in said, said[-3000:]
    assert (Path(env["PREFECT_HOME"]).stat().st_mode & 0o777) == 0o700  # made private, said so
    assert f"PREFECT_HOME {env['PREFECT_HOME']}" in said, said[:3000]
    ledger = Ledger(url)
    try:
        jobs = ledger.views.jobs("acme/agents/agent-7")
    finally:
        ledger.db.dispose()
    jobs.sort(key=lambda j: j["name"])  # trials run side by side: asked for in either order
    assert [j["name"].rsplit("/", 1)[-1] for j in jobs] == ["0000", "0001", "0002"], jobs
    stopped, *finished = jobs
    assert (stopped["outcome"], stopped["reason"]) == ("cancelled", STOPPED_BY_AGENT), stopped
    assert 0 < stopped["actual_micro"] < stopped["reserved_micro"], stopped
    assert [j["outcome"] for j in finished] == ["completed", "completed"], finished
    assert '"state":"stopping"' in said  # the cancel of a running trial
    trials = re.search(r'^\[\n  \{\n    "trial": 0.*?^\]', said, re.S | re.M)
    assert trials, said[-3000:]
    shown = json.loads(trials.group(0))
    assert [(t["outcome"], t["reason"]) for t in shown] == [
        ("cancelled", STOPPED_BY_AGENT),
        ("completed", ""),
        ("completed", ""),
    ], shown
    assert re.search(r"^trial,lr,loss", said, re.M), "no CSV results"
    assert '"learning_curves.png"' in said and "best trial" in said  # plots and summary
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert '"running_rate_usd_per_hour"' in said and '"session":"acme/agents/agent-7"' in said
    assert "revoked" in said.splitlines()[-1] or "revoked" in said[-500:], said[-500:]

    assert client.returncode == 0, client.stderr[-3000:]
    for tool in ("start_sweep", "get_sweep", "cancel_job", "get_results", "get_status"):
        assert re.search(rf"^{tool} \[", client.stdout, re.M), (tool, client.stdout)
    assert '"session":"acme/agents/agent-8"' in client.stdout.replace(" ", ""), client.stdout


def test_the_sweep_block_runs_as_written(house: tuple[dict[str, str], str], tmp_path: Path):
    """The Quick start's budgets and prices, then `sweep` and `forecast` of the README's spec
    with its `train.py`: every trial completes and reports its loss."""
    env, url = house
    _, quick_start = block("quick-start")
    setup = [
        line
        for line in quick_start.splitlines()
        if line.startswith(("prefect-gpu-budget budget set", "prefect-gpu-budget prices set-local"))
    ]
    assert len(setup) == 4, setup
    for name, file in (("sweep-spec", "sweep.yaml"), ("sweep-train", "train.py")):
        _, text = block(name)
        assert text.startswith(f"# {file}\n"), name
        (tmp_path / file).write_text(text + "\n")
    language, run = block("sweep-run")
    assert language == "bash"
    log = tmp_path / "sweep.log"
    shell = _bash("\n".join(setup) + "\n" + run, env, tmp_path, log)
    try:
        shell.wait(timeout=BASH_S)
    except subprocess.TimeoutExpired:
        _end_group(shell)
        pytest.fail(f"the sweep block ran past {BASH_S}s:\n{log.read_text()[-3000:]}")
    said = log.read_text()
    assert shell.returncode == 0, said[-3000:]
    [table] = list(tmp_path.glob("gpu-budget-results/lr-width-*/trials.csv"))
    import pandas as pd

    trials = pd.read_csv(table)
    assert len(trials) == 8 and set(trials["state"]) == {"Completed"}, trials
    assert sorted(trials["width"].unique()) == [64, 256]
    assert (trials["loss"] < 1.0).all() and trials["reason"].isna().all(), trials
    assert f"results: {table.parent}" in said, said[-3000:]
    assert re.search(r"^likely, .*: 8 of 8 trials admitted", said, re.M), said[-3000:]
    assert re.search(r"^bound, .*: 8 of 8 trials admitted", said, re.M), said[-3000:]


def test_the_quoted_forecast_is_what_the_demos_sweep_is_forecast_to_do(tmp_path, monkeypatch):
    """The Forecast section quotes the forecast of the demo's sweep (its default trials and
    seconds) on the demo's fresh ledger, as `forecast` prints it and the sweep publishes it,
    each line wrapped at 100 columns: a change to the forecast's words or figures shows here."""
    import datetime
    import inspect
    import textwrap

    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.flows.demo import demo_spec, prepare, run_demo
    from prefect_gpu_budget.sweeps.forecast import forecast

    defaults = inspect.signature(run_demo).parameters
    noon = datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.timezone.utc).timestamp()
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", "")  # the demo sets its own; put back after
    try:
        ledger = Ledger(prepare(tmp_path))
        spec = demo_spec(tmp_path, defaults["trials"].default, defaults["seconds"].default)
        said = forecast(spec, ledger, now=noon)
        ledger.db.dispose()
    finally:
        default_catalog.cache_clear()
    wrapped = [
        piece
        for line in said.describe().splitlines()
        for piece in textwrap.wrap(line, 100, subsequent_indent="  ")
    ]
    assert block("demo-forecast")[1].splitlines() == wrapped
