"""Agents apart and bounded: each agent session's jobs run as a user of its own from a uid
range (`PREFECT_GPU_BUDGET_AGENT_UIDS`), within resource limits, and leave no temp files.

Real jobs, real users: making users and switching to them needs a root worker (as CI runs);
those tests skip otherwise. The users made here are named `gpubt-...` from uids
61900-61999, and each test removes the ones it made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.errors import AdmissionRefused
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.launchers.local import LocalLauncher, marked_processes
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.sandbox.launcher import DEFAULT_LIMITS, Sandbox
from prefect_gpu_budget.sandbox.users import session_user_name
from tests.conftest import PG_URL
from tests.support.postgres import fresh_database

PREFIX = "gpubt-"
UIDS = "61900-61999"
FIRST, LAST = 61900, 61999

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making and switching users needs root")
pytestmark = pytest.mark.xdist_group("gpubt-users")
"""One worker runs these tests: `made_users` removes every `gpubt-` user made while a test ran."""


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder any user can enter (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="gpu-sessions-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _test_users() -> set[str]:
    return {p.pw_name for p in pwd.getpwall() if p.pw_name.startswith(PREFIX)}


@pytest.fixture
def made_users() -> Iterator[None]:
    """Removes the `gpubt-` users (and their groups) this test made."""
    before = _test_users()
    yield
    for name in sorted(_test_users() - before):
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)


@pytest.fixture
def sessions(base: Path, made_users) -> Sandbox:
    return Sandbox(uids=UIDS, user_prefix=PREFIX, root=base / "jobs")


@pytest.fixture
def quote(prices: Path):
    return Catalog.load(prices).quote("local:box", 1, "on-demand")


def _job(script: str, grant: str | None = None, **kw) -> tuple[GpuJob, str]:
    """A job of `grant` running `script` in sh, every process marked with a fresh TEST_TREE."""
    mark = uuid.uuid4().hex
    job = GpuJob(
        instance_type="local:box",
        command=["sh", "-c", script],
        env={"TEST_TREE": mark, **kw.pop("env", {})},
        grant=grant,
        **{"max_runtime": "2m", **kw},
    )
    return job, mark


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class Background:
    """A job running in a thread; `started()` waits for its first marked process."""

    def __init__(self, launcher: LocalLauncher, job: GpuJob, mark: str, quote) -> None:
        self.launcher, self.mark, self.ids, self.lines, self.results = launcher, mark, [], [], []
        self.thread = threading.Thread(
            target=lambda: self.results.append(
                launcher.run(
                    job,
                    quote,
                    log=self.lines.append,
                    on_start=lambda started, i: self.ids.append(i),
                )
            )
        )
        self.thread.start()

    def started(self, ready: str = "ready", timeout: float = 30) -> int:
        """The pid of the job's shell, once it printed `ready`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            pids = marked_processes("TEST_TREE", self.mark)
            if self.ids and pids and ready in self.lines:
                return min(pids)
            time.sleep(0.05)
        raise AssertionError(f"the job never started: {self.lines}")

    def stop(self):
        if self.ids:
            self.launcher.stop(self.ids[0], grace=1.0)
        self.thread.join(timeout=30)
        assert self.results, "the job did not end"
        return self.results[0]


# -- agents apart ----------------------------------------------------------------------------


@as_root
def test_two_sessions_run_as_their_own_users_and_cannot_touch_each_other(
    sessions: Sandbox, quote
) -> None:
    """Session B's job runs; session A's job, as another user of the range, can neither
    signal B's process, nor read its environment, nor list, read or write its folder. A's
    next job runs as the same user as its first."""
    grant_a, grant_b = uuid.uuid4().hex, uuid.uuid4().hex
    launcher = LocalLauncher(sessions)
    job_b, mark_b = _job('echo b-secret > "$HOME/secret.txt"; echo ready; sleep 60', grant_b)
    b = Background(launcher, job_b, mark_b, quote)
    try:
        pid_b = b.started()
        folder_b = os.readlink(f"/proc/{pid_b}/cwd")
        assert Path(folder_b, "secret.txt").read_text() == "b-secret\n"
        script = (
            'kill -0 "$B_PID" 2>/dev/null; echo "kill=$?"'
            '; kill -TERM "$B_PID" 2>/dev/null; echo "term=$?"'
            '; cat "$B_DIR/secret.txt" 2>/dev/null; echo "cat=$?"'
            '; ls "$B_DIR" >/dev/null 2>&1; echo "ls=$?"'
            '; touch "$B_DIR/planted" 2>/dev/null; echo "touch=$?"'
            '; cat "/proc/$B_PID/environ" >/dev/null 2>&1; echo "environ=$?"'
            '; echo "me=$(id -u):$(id -g) groups=$(id -G)"'
        )
        env = {"B_PID": str(pid_b), "B_DIR": folder_b}
        runs = []
        for _ in range(2):
            lines: list[str] = []
            result = launcher.run(_job(script, grant_a, env=env)[0], quote, log=lines.append)
            assert result.outcome == "completed", (result, lines)
            runs.append(lines)
        uid_b = _uid_of(pid_b)
        assert pid_b in marked_processes("TEST_TREE", mark_b)  # B was not stopped by A
    finally:
        result_b = b.stop()
    assert result_b.outcome == "failed", result_b  # stopped by SIGTERM, as asked
    for lines in runs:
        for what in ("kill", "term", "cat", "ls", "touch", "environ"):
            (said,) = (x for x in lines if x.startswith(f"{what}="))
            assert said != f"{what}=0", lines
    (me,) = {x.split()[0] for lines in runs for x in lines if x.startswith("me=")}  # reused
    uid_a, gid_a = map(int, me[3:].split(":"))
    assert uid_b is not None and uid_a != uid_b
    assert FIRST <= uid_a <= LAST and FIRST <= uid_b <= LAST

    user_a = pwd.getpwnam(session_user_name(grant_a, PREFIX))
    assert (user_a.pw_uid, user_a.pw_gid) == (uid_a, gid_a)
    assert user_a.pw_shell.endswith(("nologin", "false")) and not Path(user_a.pw_dir).exists()
    assert f"me={uid_a}:{gid_a} groups={gid_a}" in runs[0]  # its own group, and no other
    assert pwd.getpwnam(session_user_name(grant_b, PREFIX)).pw_uid == uid_b
    assert not any(p.name.startswith("sh-") for p in sessions.root.iterdir())  # folders gone


SESSION_A, SESSION_B = "acme/vision/session-a", "acme/vision/session-b"


@pytest.fixture
def gate(prices: Path) -> Iterator[Gate]:
    """A gate on a PostgreSQL ledger of this test's own, with two agent sessions' budgets."""
    with fresh_database(PG_URL) as url:
        ledger = Ledger(url)
        try:
            ledger.config.set_budget(
                BudgetRule("acme", hourly_cap_cents=2000, period_budget_micro=10_000_000)
            )
            for scope in ("acme/vision", SESSION_A, SESSION_B):
                ledger.config.set_budget(BudgetRule(scope))
            yield Gate(ledger)
        finally:
            ledger.db.dispose()


def _run_admitted(gate: Gate, admission: Admission, launcher: LocalLauncher, lines: list[str]):
    """What the job-running task does once a job is admitted: run it, settle it."""
    result = None
    try:
        result = launcher.run(
            admission.job,
            admission.quote,
            on_start=lambda started, ext: gate.holding.started(admission, started, ext),
            log=lines.append,
        )
    finally:
        ended = time.time() if result is None else result.ended_at
        outcome = "cancelled" if result is None else result.outcome
        gate.holding.settle(admission, ended_at=ended, outcome=outcome)
    return result


@as_root
def test_a_grant_is_one_sessions_so_no_two_sessions_share_a_user(
    sessions: Sandbox, gate: Gate
) -> None:
    """Users are per grant, and a grant is one session's: it is made for one session scope,
    and the gate refuses a job carrying it in any other scope, with nothing reserved. So
    session B's job cannot run as session A's user: carrying A's grant it is refused; with its
    own grant it runs as another user, and can neither signal A's running job, nor read its
    environment, nor list, read or write its folder or its file in /tmp."""
    ledger = gate.ledger
    grant_a = ledger.grants.agent_grant(ledger.grants.grant_agent(SESSION_A))[1]
    grant_b = ledger.grants.agent_grant(ledger.grants.grant_agent(SESSION_B))[1]
    launcher = LocalLauncher(sessions)
    token = uuid.uuid4().hex[:12]
    job_a, mark_a = _job(
        'echo a-secret > "$HOME/secret.txt"; echo a-secret > "/tmp/gpubt-$T-a"; echo ready'
        '; while [ ! -e "$HOME/stop" ]; do sleep 0.1; done',
        grant_a,
        env={"T": token},
    )
    lines_a: list[str] = []
    admission_a = gate.admit(job_a, SESSION_A)
    run_a = threading.Thread(target=_run_admitted, args=(gate, admission_a, launcher, lines_a))
    run_a.start()
    folder_a = None
    try:
        deadline = time.time() + 60
        while not (marked_processes("TEST_TREE", mark_a) and "ready" in lines_a):
            assert time.time() < deadline, lines_a
            time.sleep(0.05)
        pid_a = min(marked_processes("TEST_TREE", mark_a))
        folder_a = os.readlink(f"/proc/{pid_a}/cwd")

        # B's job carrying A's grant: refused at the gate, nothing reserved, nothing run
        spy = (
            'kill -0 "$A_PID" 2>/dev/null; echo "kill=$?"'
            '; kill -TERM "$A_PID" 2>/dev/null; echo "term=$?"'
            '; cat "$A_DIR/secret.txt" 2>/dev/null; echo "cat=$?"'
            '; cat "/tmp/gpubt-$T-a" 2>/dev/null; echo "tmp=$?"'
            '; ls "$A_DIR" >/dev/null 2>&1; echo "ls=$?"'
            '; touch "$A_DIR/planted" 2>/dev/null; echo "touch=$?"'
            '; cat "/proc/$A_PID/environ" >/dev/null 2>&1; echo "environ=$?"'
            '; echo "me=$(id -u)"'
        )
        env = {"A_PID": str(pid_a), "A_DIR": folder_a, "T": token}
        with pytest.raises(AdmissionRefused, match="grant") as refused:
            gate.admit(_job(spy, grant_a, env=env)[0], SESSION_B)
        [row] = [r for r in ledger.views.jobs(SESSION_B) if r["id"] == refused.value.job_id]
        assert row["started_at"] is None and not row["reserved_micro"] and not row["actual_micro"]
        assert ledger.views.jobs(SESSION_B, ("admitted", "running")) == []

        # B's job with its own grant: another user, which reaches nothing of A's
        lines_b: list[str] = []
        admission_b = gate.admit(_job(spy, grant_b, env=env)[0], SESSION_B)
        result_b = _run_admitted(gate, admission_b, launcher, lines_b)
        assert result_b is not None and result_b.outcome == "completed", (result_b, lines_b)
        for what in ("kill", "term", "cat", "tmp", "ls", "touch", "environ"):
            (said,) = (x for x in lines_b if x.startswith(f"{what}="))
            assert said != f"{what}=0", lines_b
        uid_a, uid_b = _uid_of(pid_a), int(next(x[3:] for x in lines_b if x.startswith("me=")))
        assert uid_a == pwd.getpwnam(session_user_name(grant_a, PREFIX)).pw_uid
        assert uid_b == pwd.getpwnam(session_user_name(grant_b, PREFIX)).pw_uid != uid_a
        assert pid_a in marked_processes("TEST_TREE", mark_a)  # A runs on, untouched
        assert not Path(folder_a, "planted").exists()
    finally:
        if folder_a is not None:
            Path(folder_a, "stop").touch()
        run_a.join(timeout=60)
    assert "ready" in lines_a and not run_a.is_alive()
    [settled_a] = ledger.views.jobs(SESSION_A)
    assert settled_a["state"] == "settled" and settled_a["outcome"] == "completed", settled_a
    assert not list(Path("/tmp").glob(f"gpubt-{token}-*"))  # A's last job out swept its file


@as_root
def test_a_session_user_is_made_once_by_concurrent_jobs(sessions: Sandbox, quote) -> None:
    """Four jobs of one new session start together: one user is made, all four run as it."""
    grant = uuid.uuid4().hex
    results: list = []
    lines: list[str] = []

    def one() -> None:
        job = _job('echo "uid=$(id -u)"', grant)[0]
        results.append(LocalLauncher(sessions).run(job, quote, log=lines.append))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [r.outcome for r in results] == ["completed"] * 4, (results, lines)
    uid = pwd.getpwnam(session_user_name(grant, PREFIX)).pw_uid
    assert sorted(lines) == [f"uid={uid}"] * 4
    assert [p for p in pwd.getpwall() if p.pw_uid == uid] == [pwd.getpwuid(uid)]


@as_root
def test_a_uid_is_never_given_again(sessions: Sandbox, base: Path) -> None:
    """An admin removed an old session's user (`userdel`), with a file of it left in /var/tmp,
    or nothing left at all: a new session's user never gets that uid (it would own whatever
    the old one left anywhere on the host), even once the file is gone."""
    sessions.check()  # makes the jobs' folder, where the users' lock lives
    old = sessions.session_user(uuid.uuid4().hex, create=True)
    left = Path(tempfile.mkdtemp(prefix="gpubt-left-", dir="/var/tmp"))
    try:
        os.chown(left, old.uid, old.gid)
        for tool in ("userdel", "groupdel"):
            subprocess.run([tool, old.name], capture_output=True, check=False)
        new = sessions.session_user(uuid.uuid4().hex, create=True)
        assert new.uid != old.uid and FIRST <= new.uid <= LAST, (old, new)
    finally:
        shutil.rmtree(left)
    for tool in ("userdel", "groupdel"):
        subprocess.run([tool, new.name], capture_output=True, check=False)
    again = sessions.session_user(uuid.uuid4().hex, create=True)
    assert again.uid > new.uid > old.uid, (old, new, again)  # nothing left, still not reused


@as_root
def test_check_makes_no_user(sessions: Sandbox, quote) -> None:
    """A preflight (the gateway's, the gate's) looks the user up; only a launch makes it."""
    grant = uuid.uuid4().hex
    job = _job("true", grant)[0]
    user = sessions.check(job)
    assert (user.name, user.uid, user.session) == (session_user_name(grant, PREFIX), -1, True)
    with pytest.raises(KeyError):
        pwd.getpwnam(user.name)


@pytest.mark.parametrize("uids", ["abc", "0-10", "70000-60000", "60000-"])
def test_a_bad_uid_range_is_refused_in_one_line(uids: str, base: Path, quote) -> None:
    launcher = LocalLauncher(Sandbox(uids=uids, root=base / "jobs"))
    with pytest.raises(LaunchConfigError, match="PREFECT_GPU_BUDGET_AGENT_UIDS") as refused:
        launcher.preflight(_job("true", "g")[0], quote)
    assert "\n" not in refused.value.reason


@pytest.mark.skipif(os.geteuid() == 0, reason="a root worker can make users")
def test_a_uid_range_needs_a_root_worker(base: Path, quote) -> None:
    with pytest.raises(LaunchConfigError, match="needs a root worker"):
        LocalLauncher(Sandbox(uids=UIDS, root=base / "jobs")).preflight(_job("true")[0], quote)


@as_root
def test_a_name_taken_outside_the_range_is_refused(sessions: Sandbox, quote) -> None:
    grant = uuid.uuid4().hex
    name = session_user_name(grant, PREFIX)
    subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
    with pytest.raises(LaunchConfigError, match="outside PREFECT_GPU_BUDGET_AGENT_UIDS"):
        LocalLauncher(sessions).preflight(_job("true", grant)[0], quote)


def test_from_env_reads_the_range_and_the_limits(
    monkeypatch: pytest.MonkeyPatch, base: Path
) -> None:
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_USER", "nobody")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_UIDS", " 60000-60999 ")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_LIMIT_FSIZE", "16G")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_LIMIT_NPROC", "512")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_LIMIT_AS", "")
    box = Sandbox.from_env()
    assert box.uids == "60000-60999" and box.uid_range() == (60000, 60999)
    assert dict(box.job_limits()) == {
        "nproc": 512,
        "nofile": 65536,
        "fsize": 16 << 30,
        "disk": DEFAULT_LIMITS["disk"],
        "output": DEFAULT_LIMITS["output"],
    }
    assert box == Sandbox.from_env() and hash(box) == hash(Sandbox.from_env())
    for name in ("UIDS", "LIMIT_FSIZE", "LIMIT_NPROC", "LIMIT_AS"):
        monkeypatch.delenv(f"PREFECT_GPU_BUDGET_AGENT_{name}")
    box = Sandbox.from_env()
    assert box.uids is None
    assert dict(box.job_limits()) == {k: v for k, v in DEFAULT_LIMITS.items() if v is not None}


@pytest.mark.parametrize("value", ["lots", "0", "-5", "12X", "1.5G"])
def test_a_bad_limit_is_refused_in_one_line(
    value: str, monkeypatch: pytest.MonkeyPatch, base: Path, quote
) -> None:
    monkeypatch.setenv("PREFECT_GPU_BUDGET_AGENT_LIMIT_FSIZE", value)
    box = Sandbox.from_env()
    box = Sandbox(allow_root=True, root=base / "jobs", limits=box.limits)
    with pytest.raises(LaunchConfigError, match="PREFECT_GPU_BUDGET_AGENT_LIMIT_FSIZE") as refused:
        LocalLauncher(box).preflight(_job("true")[0], quote)
    assert "\n" not in refused.value.reason
    result = LocalLauncher(box).run(_job("true")[0], quote, log=lambda line: None)
    assert result.outcome == "launch_error" and result.detail == refused.value.reason


# -- bounded ---------------------------------------------------------------------------------


def _limits(text: list[str], prefix: str = "") -> dict[str, tuple[str, str]]:
    """`/proc/<pid>/limits` lines (after `prefix`): name -> (soft, hard)."""
    found = {}
    for line in text:
        if line.startswith(prefix + "Max "):
            line = line[len(prefix) :]  # columns: "%-25s %-20s %-20s %-10s"
            found[line[:26].strip()] = (line[26:47].strip(), line[47:68].strip())
    return found


@as_root
def test_limits_bound_the_job_not_its_holder(base: Path, quote) -> None:
    box = Sandbox(
        user="nobody",
        root=base / "jobs",
        limits={"nproc": 300, "nofile": 256, "fsize": "1M", "as": "64G"},
    )
    job, _ = _job('cat /proc/self/limits; sed "s/^/holder /" "/proc/$PPID/limits"')
    lines: list[str] = []
    result = LocalLauncher(box).run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    mine = _limits(lines)
    assert mine["Max processes"] == ("300", "300")
    assert mine["Max open files"] == ("256", "256")
    assert mine["Max file size"] == (str(1 << 20), str(1 << 20))
    assert mine["Max address space"] == (str(64 << 30), str(64 << 30))
    holder = _limits(lines, "holder ")
    if holder:  # its limits are readable here: the holder is not bounded
        assert holder["Max file size"] == ("unlimited", "unlimited")
        assert holder["Max processes"] != ("300", "300")


@as_root
def test_the_default_limits_never_raise_the_workers_own(base: Path, quote) -> None:
    import resource

    job, _ = _job("cat /proc/self/limits")
    lines: list[str] = []
    result = LocalLauncher(Sandbox(user="nobody", root=base / "jobs")).run(
        job, quote, log=lines.append
    )
    assert result.outcome == "completed", (result, lines)
    mine = _limits(lines)
    hard_files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    files = str(min(65536, hard_files) if hard_files != resource.RLIM_INFINITY else 65536)
    assert mine["Max open files"] == (files, files)
    assert mine["Max processes"][1] == str(DEFAULT_LIMITS["nproc"])
    assert mine["Max file size"] == (str(256 << 30), str(256 << 30))
    assert mine["Max address space"] == ("unlimited", "unlimited")


@as_root
def test_a_job_writing_past_its_file_size_limit_fails(base: Path, quote) -> None:
    """SIGXFSZ stops the writer at the limit (the job starts with it at its default)."""
    box = Sandbox(user="nobody", root=base / "jobs", limits={"fsize": "1M"})
    job, _ = _job(
        'head -c 3145728 /dev/zero > "$HOME/big"; rc=$?'
        '; echo "rc=$rc size=$(wc -c < "$HOME/big")"; exit $rc'
    )
    lines: list[str] = []
    result = LocalLauncher(box).run(job, quote, log=lines.append)
    assert result.outcome == "failed", (result, lines)
    assert f"rc=153 size={1 << 20}" in lines  # 128 + SIGXFSZ
    assert result.exit_code == 153


@as_root
def test_a_fork_bomb_stops_at_the_process_limit(sessions: Sandbox, quote) -> None:
    """A session's user may run `nproc` processes at once: a shell starting 80 fails at the
    fork past 40 (and the holder, unbounded, waits out the rest)."""
    box = Sandbox(uids=UIDS, user_prefix=PREFIX, root=sessions.root, limits={"nproc": 40})
    job, mark = _job(
        "i=0; while [ $i -lt 80 ]; do sleep 4 & i=$((i+1)); done; echo all-started; wait",
        uuid.uuid4().hex,
    )
    most = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            most[0] = max(most[0], len(marked_processes("TEST_TREE", mark)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    lines: list[str] = []
    result = LocalLauncher(box).run(job, quote, log=lines.append)
    done.set()
    watcher.join()
    assert result.outcome == "failed", (result, lines)
    assert "all-started" not in lines and any("fork" in x.lower() for x in lines), lines
    assert 10 < most[0] <= 40, most
    assert result.runtime_s < 30


# -- no temp files left ------------------------------------------------------------------------


def _leftovers(token: str) -> list[Path]:
    return [
        path
        for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
        for path in Path(folder).glob(f"gpubt-{token}*")
    ]


LEAVE = (
    'echo x > "/dev/shm/gpubt-$T-shm"; echo x > "/tmp/gpubt-$T-tmp"'
    '; echo x > "/run/lock/gpubt-$T-lock"'
    '; mkdir "/var/tmp/gpubt-$T-dir" && echo x > "/var/tmp/gpubt-$T-dir/f"'
    '; ln -s /etc/passwd "/tmp/gpubt-$T-link"'
)


@as_root
def test_a_sessions_temp_files_are_gone_when_its_jobs_end(sessions: Sandbox, quote) -> None:
    """On the host's network (`host`: the host's temporary folders too), TMPDIR is in the
    job's folder; what the session's user leaves in /tmp, /var/tmp, /dev/shm and /run/lock
    stays while another job of it runs, and is removed when the last one ends. The files of
    others (root's, another session's running job's) stay. (An isolated job leaves nothing
    there at all: `test_isolation.py`.)"""
    sessions = dataclasses.replace(sessions, network="host")
    token = uuid.uuid4().hex[:12]
    grant, other = uuid.uuid4().hex, uuid.uuid4().hex
    mine = Path(f"/tmp/gpubt-{token}-root")
    mine.write_text("root's\n")
    launcher = LocalLauncher(sessions)
    env = {"T": token}
    first, mark = _job(
        f'{LEAVE}; echo x > "/tmp/gpubt-$T-first"; echo ready; sleep 60', grant, env=env
    )
    running = Background(launcher, first, mark, quote)
    others = Background(
        launcher,
        *_job('echo x > "/tmp/gpubt-$T-other"; echo ready; sleep 60', other, env=env),
        quote,
    )
    try:
        running.started()
        others.started()
        lines: list[str] = []
        script = 'echo x > "/tmp/gpubt-$T-second"; t=$(mktemp); echo "made=$t"; echo "tmp=$TMPDIR"'
        result = launcher.run(_job(script, grant, env=env)[0], quote, log=lines.append)
        assert result.outcome == "completed", (result, lines)
        made = Path(next(x[5:] for x in lines if x.startswith("made=")))
        tmp = Path(next(x[4:] for x in lines if x.startswith("tmp=")))
        assert made.parent == tmp and tmp.parent.parent == sessions.root
        assert not tmp.parent.exists()  # the job's folder, its TMPDIR with it, is gone
        names = {p.name for p in _leftovers(token)}
        for left in ("tmp", "dir", "link", "shm", "lock", "first", "second", "other", "root"):
            assert f"gpubt-{token}-{left}" in names, (left, names)  # the first job still runs
    finally:
        running.stop()
    try:
        names = {p.name for p in _leftovers(token)}
        assert names == {f"gpubt-{token}-other", f"gpubt-{token}-root"}, names
        assert Path("/etc/passwd").exists() and mine.read_text() == "root's\n"
    finally:
        others.stop()
        mine.unlink()
    assert {p.name for p in _leftovers(token)} == set()


@as_root
def test_the_shared_agent_users_temp_files_stay(base: Path, quote) -> None:
    """With one agent user for all (here `nobody`, which other programs may be), on the host's
    network (`host`: the host's /tmp too), what it leaves in /tmp is not removed: it may be
    another agent's running job's, or not an agent's at all. Its TMPDIR, in the job's folder,
    goes with the folder."""
    token = uuid.uuid4().hex[:12]
    job, _ = _job('echo x > "/tmp/gpubt-$T-nobody"; mktemp', env={"T": token})
    lines: list[str] = []
    try:
        box = Sandbox(user="nobody", root=base / "jobs", network="host")
        result = LocalLauncher(box).run(job, quote, log=lines.append)
        assert result.outcome == "completed", (result, lines)
        assert [p.name for p in _leftovers(token)] == [f"gpubt-{token}-nobody"]
        assert not Path(lines[-1]).exists() and Path(lines[-1]).parent.name == "tmp"
    finally:
        for path in _leftovers(token):
            path.unlink()


# -- no outliving the bill -------------------------------------------------------------------

FORK_CHAIN = '$| = 1; print "chain\\n"; while (1) { fork and POSIX::_exit(0) }'
"""A process that forks and leaves at once, for ever: each one lives a fraction of a
millisecond, far less than one walk of /proc takes, so a stop that signals the processes it
found in /proc always signals ones already gone."""


@as_root
def test_a_fork_chain_ends_at_max_runtime_with_its_job(sessions: Sandbox, quote) -> None:
    """Past max_runtime and its kill grace the job's whole tree is gone, however fast it forks:
    the job runs in a PID namespace of its own, and its init's end takes every process in it
    with it at once. The job is billed no longer than its reservation's span (plus slack)."""
    job, mark = _job(
        'for i in 1 2 3 4; do perl -MPOSIX -e "$CHAIN" & done; sleep 600',
        uuid.uuid4().hex,
        env={"CHAIN": FORK_CHAIN},
        max_runtime="2s",
        kill_grace=1,
    )
    lines: list[str] = []
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(LocalLauncher(sessions).run(job, quote, log=lines.append)),
        daemon=True,
    )
    thread.start()
    thread.join(timeout=40)
    survivors = marked_processes("TEST_TREE", mark)
    for pid in survivors:  # leave the machine clean whatever happened
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    assert not thread.is_alive(), f"the job still runs 40 s after a 2 s max_runtime: {lines}"
    assert "chain" in lines, lines
    assert result[0].runtime_s < 2 + 1 + 10, result[0]
    assert survivors == [], survivors


@as_root
def test_a_job_runs_in_a_pid_namespace_of_its_own(sessions: Sandbox, quote) -> None:
    """The job runs in its own PID namespace (the shell's parent is its init, pid 1), and its
    /proc is that namespace's: its own pid there, and none of the host's processes."""
    job, _ = _job("grep NSpid /proc/self/status; echo parent=$PPID; ls /proc | grep -c '^[0-9]'")
    lines: list[str] = []
    result = LocalLauncher(sessions).run(job, quote, log=lines.append)
    assert result.outcome == "completed", (result, lines)
    nspid = next(x for x in lines if x.startswith("NSpid:")).split()[1:]
    assert len(nspid) == 1 and 1 < int(nspid[0]) < 10, lines  # no host pid to be seen
    assert "parent=1" in lines, lines  # the shell's parent: the namespace's init
    assert int(lines[-1]) <= 5, lines  # init, sh, ls, grep: nothing of the host's
