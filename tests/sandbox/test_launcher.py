"""The sandbox agents' local jobs run in: real jobs, as `nobody`, with secrets planted in the
worker's environment.

Switching users needs a root worker (as CI runs); those tests skip otherwise. Timing bounds
are generous: the test machine is small and busy.
"""

from __future__ import annotations

import json
import os
import pickle
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.launchers.local import JOB_MARK_ENV, LocalLauncher, marked_processes
from prefect_gpu_budget.launchers.registry import launcher_for
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.sandbox.env import DEFAULT_ENV_ALLOW, Redactor, known_secrets
from prefect_gpu_budget.sandbox.launcher import ROOT_REFUSED, Sandbox
from prefect_gpu_budget.settings import METRICS_ENV

SLACK_S = 5.0
"""What a busy 2-core machine may add to any bound here."""
TOKEN = uuid.uuid4().hex[:12]
AWS_SECRET = f"planted-aws-{TOKEN}"
LEDGER_PASSWORD = f"planted-pw-{TOKEN}"
AUTH_STRING = f"admin:planted-auth-{TOKEN}"
PLANTED = (AWS_SECRET, LEDGER_PASSWORD, AUTH_STRING, f"planted-auth-{TOKEN}")

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs a root worker")


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:  # pragma: no cover - every Linux has it
        pytest.skip("no user 'nobody' here")


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's secrets, as a worker holds them."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv(
        "PREFECT_GPU_BUDGET_LEDGER_URL",
        f"postgresql://postgres:{LEDGER_PASSWORD}@127.0.0.1:5432/x",
    )
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", AUTH_STRING)


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder any user can enter (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="gpu-sandbox-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sandbox(base: Path) -> Sandbox:
    return Sandbox(user="nobody", root=base / "jobs")


@pytest.fixture
def quote(prices: Path):
    return Catalog.load(prices).quote("local:box", 1, "on-demand")


def _job(script: str, **kw) -> tuple[GpuJob, str]:
    """A job running `script` in sh, every process of it marked with a fresh TEST_TREE."""
    mark = uuid.uuid4().hex
    job = GpuJob(
        instance_type="local:box",
        command=["sh", "-c", script],
        env={"TEST_TREE": mark, **kw.pop("env", {})},
        **{"max_runtime": "1m", **kw},
    )
    return job, mark


def _marked(mark: str) -> list[int]:
    return marked_processes("TEST_TREE", mark)


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# -- what the job sees, and what the log shows --------------------------------------------


@as_root
def test_the_job_gets_no_secret_runs_as_nobody_in_a_fresh_home(
    planted, sandbox, quote, base
) -> None:
    """The job's environment (written, unredacted, to its metrics file) holds none of the
    worker's secrets; the log shows none either, not even one the command line itself holds;
    it runs as nobody, in a fresh folder of its own that is its HOME."""
    script = (
        'env > "$GPU_BUDGET_METRICS_FILE"; env;'
        ' echo "aws=$AWS_SECRET_ACCESS_KEY"'
        f"; echo known {AWS_SECRET} {LEDGER_PASSWORD} {AUTH_STRING}"
        '; echo "uid=$(id -u)"; echo "pwd=$(pwd)"; echo "home=$HOME"'
        '; touch "$HOME/mine" && echo wrote-home'
        "; grep NoNewPrivs /proc/self/status"
    )
    job, _ = _job(script, name="sweep/0003")
    target = base / "results" / "trial-0003.jsonl"
    target.parent.mkdir(mode=0o700)  # the worker's results folder: out of nobody's reach
    runs = []
    for _ in range(2):
        lines: list[str] = []
        result = LocalLauncher(sandbox).run(
            job, quote, log=lines.append, env={METRICS_ENV: str(target)}
        )
        assert result.outcome == "completed", (result, lines)
        runs.append(lines)

    env_text = target.read_text()
    for secret in PLANTED:
        assert secret not in env_text
    names = {line.split("=", 1)[0] for line in env_text.splitlines() if "=" in line}
    assert not {n for n in names if n.startswith(("PREFECT", "AWS_", "GOOGLE_"))}, names
    expected = set(DEFAULT_ENV_ALLOW) | {"HOME", "TMPDIR", "PYTHONPATH", "PWD", JOB_MARK_ENV}
    expected.add("TEST_TREE")
    assert names <= expected | {METRICS_ENV, "OLDPWD", "SHLVL", "_"}, names - expected

    homes = []
    for lines in runs:
        text = "\n".join(lines)
        for secret in PLANTED:
            assert secret not in text
        assert "aws=" in lines  # the variable is not there at all
        assert "known *** *** ***" in lines  # ... and what the job knew anyway is redacted
        assert f"uid={_nobody().pw_uid}" in lines
        assert "NoNewPrivs:\t1" in lines  # no setuid program (crontab, at, sudo) helps it
        home = next(line[5:] for line in lines if line.startswith("home="))
        assert f"pwd={home}" in lines and "wrote-home" in lines
        assert Path(home).parent == sandbox.root and Path(home).name.startswith("sweep-0003-")
        assert not Path(home).exists()  # removed once the job ended
        homes.append(home)
    assert homes[0] != homes[1]  # a fresh folder each time
    assert stat.S_IMODE(sandbox.root.stat().st_mode) == 0o711  # no user can list the folders


@as_root
def test_the_job_cannot_kill_its_holder(sandbox, quote) -> None:
    job, _ = _job('kill -KILL "$PPID"; echo "kill=$?"')
    lines: list[str] = []
    result = LocalLauncher(sandbox).run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    assert [x for x in lines if x.startswith("kill=")] == ["kill=1"], lines  # not permitted


@as_root
def test_the_holder_stays_root_with_none_of_the_jobs_variables(sandbox, quote) -> None:
    """The holder is root: a variable the job sets (LD_PRELOAD) must never reach it."""
    job, mark = _job('echo "preload=$LD_PRELOAD"; sleep 30', env={"LD_PRELOAD": "/no/such/lib.so"})
    ids: list[str] = []
    seen: dict[str, object] = {}
    launcher = LocalLauncher(sandbox)

    def look(started: float, external_id: str) -> None:
        ids.append(external_id)

    lines: list[str] = []
    runner = threading.Thread(
        target=lambda: launcher.run(job, quote, log=lines.append, on_start=look)
    )
    runner.start()
    deadline = time.time() + 30
    # The job is marked before its echo runs: wait for the line, not the process alone.
    while not (ids and _marked(mark) and any("preload=" in line for line in lines)):
        if time.time() > deadline:
            break
        time.sleep(0.1)
    assert ids and _marked(mark), "the job never started"
    holder = int(ids[0].split(":")[0])
    with open(f"/proc/{holder}/environ", "rb") as handle:
        seen["names"] = {item.split(b"=", 1)[0] for item in handle.read().split(b"\0") if item}
    seen["uid"] = _uid_of(holder)
    launcher.stop(ids[0], grace=1.0)
    runner.join(timeout=30)
    assert seen["uid"] == 0
    assert seen["names"] <= {JOB_MARK_ENV.encode(), b"LD_LIBRARY_PATH"}, seen
    assert "preload=/no/such/lib.so" in lines  # the job itself has what it asked for
    assert _marked(mark) == []


@as_root
def test_gpu_assignment_reaches_the_sandboxed_job(
    monkeypatch: pytest.MonkeyPatch, sandbox, quote
) -> None:
    """CUDA_VISIBLE_DEVICES: the GPUs granted to the job on a GPU machine, else the worker's."""
    from prefect_gpu_budget.launchers.local import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    job, _ = _job('echo "gpus=$CUDA_VISIBLE_DEVICES"')
    lines: list[str] = []
    result = LocalLauncher(sandbox).run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    shown = next(x[5:] for x in lines if x.startswith("gpus="))
    assert len(shown.split(",")) == 1 and (visible_gpus() or shown == "0"), shown


@as_root
def test_a_metrics_file_swapped_for_a_link_is_not_followed(sandbox, quote, base) -> None:
    """The job replaces its metrics file with a link to a file only root may read: the worker
    (root) copies nothing of it."""
    secret = base / "secret.txt"
    secret.write_text(f"root-only {TOKEN}\n")
    secret.chmod(0o600)
    job, _ = _job(f'rm "$GPU_BUDGET_METRICS_FILE"; ln -s {secret} "$GPU_BUDGET_METRICS_FILE"')
    target = base / "metrics.jsonl"
    result = LocalLauncher(sandbox).run(
        job, quote, log=lambda line: None, env={METRICS_ENV: str(target)}
    )
    assert result.outcome == "completed", result
    assert TOKEN not in (target.read_text() if target.exists() else "")


def test_redaction_of_withheld_values_and_url_passwords() -> None:
    environ = {
        "SECRET": "s3cr3t-value-1",
        "SHORT": "true",
        "URL": "postgresql://u:p%40ss-w0rd@db:5432/x",
        "GIVEN": "also-given-value",
        "PYENV_ROOT": "/root/.pyenv",
    }
    given = {"GIVEN": "also-given-value", "PATH": "/root/.pyenv/bin:/usr/bin"}
    secrets = known_secrets(given, environ)
    assert "s3cr3t-value-1" in secrets and "p@ss-w0rd" in secrets and "p%40ss-w0rd" in secrets
    assert "true" not in secrets and "also-given-value" not in secrets
    assert "/root/.pyenv" not in secrets  # the job was given it, inside PATH
    redact = Redactor(secrets)
    line = "s3cr3t-value-1 true p@ss-w0rd also-given-value https://x:tok@h/ /root/.pyenv/bin"
    assert redact(line) == "*** true *** also-given-value https://***@h/ /root/.pyenv/bin"
    assert Redactor(["abc", "abcdef"])("abcdefg") == "***g"  # the longest first


# -- settings ----------------------------------------------------------------------------


def test_from_env_reads_the_admin_settings(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_USER", "nobody")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_ALLOW_ROOT", "true")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_ENV", "HF_HOME, MY_*,PATH")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_ROOT", str(tmp_path / "jobs"))
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_PYTHON", " /opt/py/bin/python3 ")
    box = Sandbox.from_env()
    assert box.user == "nobody" and box.allow_root is True and box.python == "/opt/py/bin/python3"
    assert box.env_allow == (*DEFAULT_ENV_ALLOW, "HF_HOME", "MY_*")
    assert box.root == tmp_path / "jobs"
    for name in ("AGENT_USER", "AGENT_ALLOW_ROOT", "AGENT_ENV", "AGENT_ROOT", "AGENT_PYTHON"):
        monkeypatch.delenv(f"PREFECT_GPU_BUDGET_{name}")
    box = Sandbox.from_env()
    assert box.user is None and box.allow_root is False and box.env_allow == DEFAULT_ENV_ALLOW
    assert box.python is None
    assert box.root == Path(tempfile.gettempdir()) / "gpu-budget-agent-jobs"


SECRET_NAMES = (
    "AWS_SECRET_ACCESS_KEY",
    "PREFECT_API_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GITHUB_TOKEN",
    "DB_PASSWORD",
    "APIKEY",
    "DB_PASS",
    "DATABASE_URL",
    "GITHUB_PAT",
    "github_pat",
    "my_apikey",
    "OPENAI_API_KEY",
    "MYSQL_PWD",
    "SSH_AUTH_SOCK",
    "OAUTH_CLIENT",
    "TLS_PRIVATE_PEM",
    "SENTRY_DSN",
    "AZURE_STORAGE_CONNECTION_STRING",
    "CLOUDSDK_AUTH_ACCESS_TOKEN_FILE",
    "KRB5_KEYTAB",
    "NETRC",
    "SESSION_COOKIE",
)


def test_patterns_never_let_secrets_through() -> None:
    """`*` passes none of the names that hold secrets (in any case), nor a value carrying a
    URL's credentials; an exact name still passes."""
    box = Sandbox(env_allow=("*", "AWS_REGION", "DATABASE_URL"))
    environ = {
        "LC_NUMERIC": "C",
        "PATH": "/usr/bin",
        "AWS_REGION": "us-east-1",
        "HF_HOME": "/data/hf",
        "REDIS_URL": "redis://:hunter22@cache:6379/0",
        "MLFLOW_TRACKING_URI": "https://mlflow.internal/",
        **{name: "x" for name in SECRET_NAMES},
    }
    assert box.allowed_env(environ) == {
        "LC_NUMERIC": "C",
        "PATH": "/usr/bin",
        "AWS_REGION": "us-east-1",
        "HF_HOME": "/data/hf",
        "MLFLOW_TRACKING_URI": "https://mlflow.internal/",
        "DATABASE_URL": "x",  # named exactly
    }
    assert Sandbox(env_allow=("LC_*",)).allowed_env(environ) == {"LC_NUMERIC": "C"}
    assert Sandbox(env_allow=("*_PAT", "DB_*")).allowed_env(environ) == {}
    assert Sandbox(env_allow=("APIKEY", "GITHUB_PAT")).allowed_env(environ) == {
        "APIKEY": "x",
        "GITHUB_PAT": "x",
    }


def test_a_sandboxed_launcher_is_a_plain_value(base) -> None:
    """Task parameters are hashed and serialised: a launcher with a sandbox compares, hashes
    and pickles by value; `LocalLauncher()` is what it always was."""
    launcher = LocalLauncher(Sandbox(user="nobody", root=base))
    assert pickle.loads(pickle.dumps(launcher)) == launcher
    assert hash(launcher) == hash(LocalLauncher(Sandbox(user="nobody", root=base)))
    assert LocalLauncher() == LocalLauncher() and LocalLauncher().sandbox is None
    assert launcher_for("local") == LocalLauncher()


# -- refusals ----------------------------------------------------------------------------


@as_root
def test_root_without_an_agent_user_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, base, quote
) -> None:
    for name in ("AGENT_USER", "AGENT_ALLOW_ROOT"):
        monkeypatch.delenv(f"PREFECT_GPU_BUDGET_{name}", raising=False)
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_ROOT", str(base / "jobs"))
    launcher = LocalLauncher(Sandbox.from_env())
    job, mark = _job(f"touch {base}/started; sleep 30")
    with pytest.raises(LaunchConfigError) as refused:
        launcher.preflight(job, quote)
    assert refused.value.reason == ROOT_REFUSED and "\n" not in ROOT_REFUSED
    result = launcher.run(job, quote, log=lambda line: None)
    assert result.outcome == "launch_error" and result.detail == ROOT_REFUSED
    assert result.started_at == result.ended_at and result.exit_code is None
    assert not (base / "started").exists() and _marked(mark) == []


@pytest.mark.parametrize("user", ["no-such-user-here", "root"])
def test_an_unknown_or_root_agent_user_is_refused(user: str, base, quote) -> None:
    launcher = LocalLauncher(Sandbox(user=user, root=base / "jobs"))
    job, _ = _job("true")
    with pytest.raises(LaunchConfigError, match=user) as refused:
        launcher.preflight(job, quote)
    assert "\n" not in refused.value.reason
    result = launcher.run(job, quote, log=lambda line: None)
    assert result.outcome == "launch_error" and result.detail == refused.value.reason


@as_root
def test_allow_root_runs_as_root_with_the_environment_still_stripped(planted, base, quote) -> None:
    launcher = LocalLauncher(Sandbox(allow_root=True, root=base / "jobs"))
    job, _ = _job('echo "uid=$(id -u) aws=$AWS_SECRET_ACCESS_KEY"')
    lines: list[str] = []
    result = launcher.run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    assert "uid=0 aws=" in lines


@as_root
def test_a_program_out_of_the_users_reach_is_refused(sandbox, base, quote) -> None:
    private = base / "private"
    private.mkdir(mode=0o700)
    program = private / "train.sh"
    program.write_text("#!/bin/sh\necho trained\n")
    program.chmod(0o755)
    job = GpuJob(instance_type="local:box", command=[str(program)], max_runtime="1m")
    with pytest.raises(LaunchConfigError, match="not searchable by 'nobody'"):
        LocalLauncher(sandbox).preflight(job, quote)


@pytest.mark.skipif(os.geteuid() == 0, reason="a root worker can switch users")
def test_a_worker_that_is_not_root_cannot_switch_user(base, quote) -> None:
    other = "nobody" if os.geteuid() != _nobody().pw_uid else "root"
    with pytest.raises(LaunchConfigError, match="cannot switch user|is root"):
        LocalLauncher(Sandbox(user=other, root=base / "jobs")).preflight(_job("true")[0], quote)


@pytest.mark.skipif(os.geteuid() == 0, reason="runs as the worker's own user only when not root")
def test_a_worker_that_is_not_root_runs_jobs_as_itself_with_a_warning(
    planted, base, quote, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect_gpu_budget.sandbox import launcher as module

    monkeypatch.setattr(module, "_warned_own_user", False)  # once per process: this one
    job, _ = _job('echo "uid=$(id -u) aws=$AWS_SECRET_ACCESS_KEY"')
    lines: list[str] = []
    with caplog.at_level("WARNING", logger=module.__name__):
        for _ in range(2):
            result = LocalLauncher(Sandbox(root=base / "jobs")).run(job, quote, log=lines.append)
            assert result.outcome == "completed" and f"uid={os.geteuid()} aws=" in lines
    warned = [r for r in caplog.records if "can write whatever that user can" in r.getMessage()]
    assert len(warned) == 1, caplog.records


# -- the job's whole tree, as nobody ------------------------------------------------------


@as_root
def test_max_runtime_stops_the_sandboxed_tree(sandbox, quote) -> None:
    """Escaped children of nobody (one ignoring SIGTERM) are stopped at max_runtime, by the
    holder that nobody cannot touch."""
    job, mark = _job(
        "nohup sleep 60 >/dev/null 2>&1 &"
        " setsid sleep 60 >/dev/null 2>&1 &"
        " setsid sh -c 'trap \"\" TERM; sleep 60' >/dev/null 2>&1 &"
        " sleep 60",
        max_runtime="2s",
        kill_grace="1s",
    )
    uids: set[int | None] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            uids.update(_uid_of(pid) for pid in _marked(mark))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = LocalLauncher(sandbox).run(job, quote, log=lambda line: None)
    stop.set()
    watcher.join()
    assert result.outcome == "timed_out", result
    assert 2.0 <= result.runtime_s < 2 + 1 + SLACK_S, result.runtime_s
    assert uids - {None} == {_nobody().pw_uid}, uids
    assert _marked(mark) == []


@as_root
def test_an_escaped_child_of_nobody_is_killed_when_the_holder_dies(sandbox, quote) -> None:
    """The holder is SIGKILLed (nothing of it cleans up): the launcher finds the job's escaped
    `setsid` child of nobody by its mark (root reads nobody's environment) and kills it."""
    job, mark = _job("setsid sleep 60 >/dev/null 2>&1 & sleep 60")
    ids: list[str] = []
    results = []
    runner = threading.Thread(
        target=lambda: results.append(
            LocalLauncher(sandbox).run(
                job, quote, log=lambda line: None, on_start=lambda s, i: ids.append(i)
            )
        )
    )
    runner.start()
    deadline = time.time() + 30
    while not (ids and len(_marked(mark)) >= 2) and time.time() < deadline:  # sh, setsid child
        time.sleep(0.1)
    assert ids and len(_marked(mark)) >= 2, "the job never started"
    os.kill(int(ids[0].split(":")[0]), signal.SIGKILL)
    runner.join(timeout=30)
    assert results and results[0].runtime_s < 30
    deadline = time.time() + SLACK_S  # a SIGKILLed process takes a moment to be reaped
    while _marked(mark) and time.time() < deadline:
        time.sleep(0.1)
    assert _marked(mark) == []


# -- Python, as nobody ------------------------------------------------------------------------


def _agent_python(sandbox: Sandbox) -> str:
    python = sandbox.interpreter(sandbox.job_user())
    if python is None:
        pytest.skip(f"no Python that {sandbox.user} may run here")
    return python


@as_root
def test_python_on_the_jobs_path_runs_as_nobody(sandbox, quote, base) -> None:
    """`python` and `python3` are an interpreter nobody can run, whichever this worker's is."""
    python = _agent_python(sandbox)
    script = (
        "import json, os, subprocess, sys\n"
        "other = subprocess.run(['python3', '-c', 'import sys; print(sys.executable)'],"
        " capture_output=True, text=True).stdout.strip()\n"
        "line = {'loss': 0.5, 'uid': os.getuid(), 'python': sys.executable, 'python3': other}\n"
        "with open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a') as handle:\n"
        "    handle.write(json.dumps(line) + '\\n')\n"
        "print('ran', sys.version_info[0])\n"
    )
    job = GpuJob(instance_type="local:box", command=["python", "-c", script], max_runtime="1m")
    LocalLauncher(sandbox).preflight(job, quote)
    target = base / "python.jsonl"
    lines: list[str] = []
    result = LocalLauncher(sandbox).run(
        job, quote, log=lines.append, env={METRICS_ENV: str(target)}
    )
    assert result.outcome == "completed", (result, lines)
    assert "ran 3" in lines
    (line,) = (json.loads(text) for text in target.read_text().splitlines())
    assert line == {"loss": 0.5, "uid": _nobody().pw_uid, "python": python, "python3": python}


@pytest.fixture
def agent_code(base: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`agent_trial.py` (sandbox_trial.py) in a folder nobody can read, on the worker's
    PYTHONPATH (which the sandbox below lets through)."""
    folder = base / "agent-code"
    folder.mkdir(mode=0o755)
    shutil.copy(Path(__file__).with_name("sandbox_trial.py"), folder / "agent_trial.py")
    (folder / "agent_trial.py").chmod(0o644)
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return folder


@as_root
@pytest.mark.parametrize("source_at", ["src", "private", "site-packages"])
def test_a_callable_trial_runs_as_nobody(
    source_at: str, planted, agent_code, base, quote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's `callable:` trial starts with this worker's interpreter: the sandbox starts
    it with nobody's, and its PYTHONPATH reaches the trial runner: this package's source where
    nobody can read it, else (private, or installed) a copy of the few files the runner
    imports (which are all it needs: the source here holds only those)."""
    from prefect_gpu_budget.sandbox import interpreter
    from prefect_gpu_budget.sweeps.spec import SweepSpec

    source = base / source_at
    source.mkdir(mode=0o700 if source_at == "private" else 0o755)
    for rel in interpreter.TRIAL_SOURCES:
        (source / rel).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        shutil.copy(Path(interpreter.package_source()) / rel, source / rel)
    monkeypatch.setattr(interpreter, "package_source", lambda: str(source))
    sandbox = Sandbox(
        user="nobody", root=base / "jobs", env_allow=(*DEFAULT_ENV_ALLOW, "PYTHONPATH")
    )
    python = _agent_python(sandbox)
    spec = SweepSpec(
        name="trial",
        scope="lab/sweeps",
        job={"instance_type": "local:box", "max_runtime": "2m"},
        callable="agent_trial:train",
        grid={"lr": [0.5]},
    )
    job = spec.job_for({"lr": 0.5}, "trial/0001")
    assert job.command and job.command[0] == sys.executable
    LocalLauncher(sandbox).preflight(job, quote)
    prepared = sandbox.prepare(job, {})
    prepared.finish()
    assert prepared.command == [python, *job.command[1:]]
    job = job.model_copy(update={"command": prepared.command})  # as the launcher runs it

    target = base / "trial.jsonl"
    lines: list[str] = []
    result = LocalLauncher(sandbox).run(
        job, quote, log=lines.append, env={METRICS_ENV: str(target)}
    )
    assert result.outcome == "completed", (result, lines)
    step, summary = (json.loads(line) for line in target.read_text().splitlines())
    assert step == {"step": 1, "loss": 0.5}
    assert summary["summary"] is True and summary["loss"] == 0.25
    assert summary["uid"] == _nobody().pw_uid and summary["python"] == python
    assert summary["home"] == summary["cwd"] and Path(summary["cwd"]).parent == sandbox.root
    runner = Path(summary["runner"])
    if source_at == "src":
        assert runner == source / "prefect_gpu_budget" / "sweeps" / "trial.py"
    else:
        assert runner == Path(summary["cwd"], ".gpu-budget/lib/prefect_gpu_budget/sweeps/trial.py")
    assert not [n for n in summary["names"] if n.startswith(("PREFECT", "AWS_", "GOOGLE_"))]


@as_root
def test_a_venvs_interpreter_keeps_its_venv(base, quote) -> None:
    """`python` starts the interpreter by its own path, so a venv's finds its venv."""
    venv = base / "venv"
    made = subprocess.run(
        ["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"no venv from /usr/bin/python3 here: {made.stderr[-200:]!r}")
    sandbox = Sandbox(user="nobody", root=base / "jobs", python=str(venv / "bin" / "python"))
    job = GpuJob(
        instance_type="local:box",
        command=["python3", "-c", "import sys; print('prefix=' + sys.prefix)"],
        max_runtime="1m",
    )
    lines: list[str] = []
    result = LocalLauncher(sandbox).run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    assert f"prefix={venv}" in lines


def test_an_agent_python_that_is_not_there_is_refused(base, quote) -> None:
    launcher = LocalLauncher(Sandbox(allow_root=True, root=base / "jobs", python="no-such-python"))
    with pytest.raises(LaunchConfigError, match="PREFECT_GPU_BUDGET_AGENT_PYTHON") as refused:
        launcher.preflight(_job("true")[0], quote)
    assert "no such program" in refused.value.reason and "\n" not in refused.value.reason


@as_root
def test_no_python_nobody_can_run_is_refused_in_one_line(
    sandbox, base, quote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent Python out of nobody's reach refuses every job; with none at all (this worker's
    out of reach, no system one), a job that needs one is refused, and the others run."""
    from prefect_gpu_budget.sandbox import launcher as module

    private = base / "private"
    private.mkdir(mode=0o700)
    hidden = private / "python3"
    hidden.write_text("#!/bin/sh\n")
    hidden.chmod(0o755)
    launcher = LocalLauncher(Sandbox(user="nobody", root=base / "jobs", python=str(hidden)))
    with pytest.raises(LaunchConfigError, match="not searchable by 'nobody'") as refused:
        launcher.preflight(_job("true")[0], quote)
    assert "PREFECT_GPU_BUDGET_AGENT_PYTHON" in refused.value.reason

    monkeypatch.setattr(module, "SYSTEM_PYTHONS", ())
    monkeypatch.setattr(sys, "executable", str(hidden))  # only preflight runs meanwhile
    for command in (["python", "train.py"], ["python3", "-c", "1"], [str(hidden), "-m", "x"]):
        job = GpuJob(instance_type="local:box", command=command, max_runtime="1m")
        with pytest.raises(LaunchConfigError, match="PREFECT_GPU_BUDGET_AGENT_PYTHON") as refused:
            LocalLauncher(sandbox).preflight(job, quote)
        assert refused.value.reason.startswith("no Python that 'nobody' can run")
        assert "\n" not in refused.value.reason
    LocalLauncher(sandbox).preflight(_job("true")[0], quote)


# -- the worker's files, from nobody --------------------------------------------------------


def test_a_new_sqlite_ledger_is_its_owners_alone(tmp_path) -> None:
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    ledger = Ledger(f"sqlite:///{tmp_path / 'gpu-budget' / 'ledger.db'}")
    try:
        ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=100))
        for path in (tmp_path / "gpu-budget").iterdir():  # the -wal and -shm files too
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        ledger.db.dispose()


@as_root
def test_nobody_cannot_touch_the_ledger_prices_or_prefect_home(
    monkeypatch: pytest.MonkeyPatch, sandbox, base, quote
) -> None:
    """The worker's ledger, prices and PREFECT_HOME, where nobody can reach them by path:
    writing any (and reading the ledger) fails on the files' own modes."""
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.rules.policy import BudgetRule
    from prefect_gpu_budget.pricing.catalog import set_local_price
    from prefect_gpu_budget.settings import ledger_url, prefect_home

    home = base / "prefect-home"
    prices = home / "gpu-budget" / "prices.csv"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.delenv("PREFECT_GPU_BUDGET_LEDGER_URL", raising=False)
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    ledger = Ledger(ledger_url())
    try:
        ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=100))
        set_local_price("box", "3.6", gpus=1, path=prices)
        db = home / "gpu-budget" / "ledger.db"
        assert db.exists() and prefect_home() == home
        before = {p: p.read_bytes() for p in (db, prices)}
        script = (
            'for f in "$DB" "$DB-wal" "$DB-shm" "$PRICES"; do'
            '  if echo x >> "$f"; then echo "wrote $f"; fi;'
            "done;"
            ' if touch "$PH/agent-was-here"; then echo wrote-home; fi;'
            ' if cat "$DB" >/dev/null; then echo read-ledger; fi;'
            ' if sqlite3 "$DB" "delete from gpu_jobs" 2>/dev/null; then echo sqlite-wrote; fi;'
            " echo done"
        )
        job, _ = _job(script, env={"DB": str(db), "PRICES": str(prices), "PH": str(home)})
        lines: list[str] = []
        result = LocalLauncher(sandbox).run(job, quote, log=lines.append)
        assert "done" in lines, (result, lines)
        assert not [x for x in lines if x.startswith(("wrote", "read-", "sqlite-"))], lines
        assert not (home / "agent-was-here").exists()
        assert {p: p.read_bytes() for p in before} == before
        ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=200))  # the worker still can
    finally:
        ledger.db.dispose()
