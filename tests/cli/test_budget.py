"""The CLI: its ledger and catalog commands, and the package itself, import neither Prefect nor
pandas, matplotlib or a cloud SDK (their speed is measured in benchmarks/cli_latency.py); admin
commands change only what they are given, atomically, under the org's lock (real processes race
each other on SQLite and PostgreSQL, each setting a different field: every change survives); and
`sweep` runs a YAML sweep.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.blocks import GpuBudget
from tests.conftest import PG_URL
from tests.jobs import new_job
from tests.postgres import fresh_database, require_postgres

HEAVY = ("prefect", "pandas", "matplotlib", "boto3", "google.cloud.aiplatform", "prefect_aws")

_PROBE = """
import json, sys
from prefect_gpu_budget.cli import main
args, watched = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["prefect-gpu-budget", *args]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
heavy = [m for m in watched if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""

COMMANDS = [
    ["budget", "set", "acme", "--hourly-cap", "50", "--period-budget", "500"],
    ["budget", "set", "acme/vision", "--hourly-cap", "20"],
    ["budget", "show"],
    ["budget", "show", "--json"],
    ["status", "--json"],
    ["status"],
    ["ledger", "--json", "--limit", "20"],
    ["ledger"],
    ["quote", "aws:g5.xlarge", "--hours", "2"],
    ["prices", "set-local", "box", "--usd-per-hour", "2.5"],
    ["pool", "set", "acme", "lab", "--nodes", "2", "--gpus-per-node", "8"],
    ["pool", "quota", "acme/vision", "--pool", "lab", "--gpus", "4"],
    ["capacity", "acme"],
    ["priority", "set", "acme", "urgent", "--value", "500"],
    ["priority", "list", "acme"],
    ["priority", "remove", "acme", "urgent"],
    ["prices", "list"],
    ["budget", "set", "acme/vision", "--session-template", "--hourly-cap", "5"],
    ["agent", "grant", "acme/vision/agent-7"],
    ["agent", "limits", "acme/vision", "--max-sweeps", "3"],
    ["agent", "revoke", "acme/vision/agent-7"],
    ["reconcile"],
    ["budget", "set", "acme", "--hourly-cap", "-1"],  # a refusal takes the same path
]


def _run(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(HEAVY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_ledger_commands_import_no_prefect(kind: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    if kind == "postgresql":
        require_postgres(PG_URL)
        from tests.conftest import _fresh_pg

        url = _fresh_pg()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_GPU_BUDGET_LEDGER_URL": url,
        "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "prices.csv"),
        # a configured server that reconcile must not contact when nothing needs releasing
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
    }
    for args in COMMANDS:
        found = _run(args, env)
        assert found["heavy"] == [], f"{' '.join(args)} imported {found['heavy']}"
        assert found["code"] == (2 if "-1" in args else 0), args


def test_import_of_the_package_is_light() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, prefect_gpu_budget, prefect_gpu_budget.admission.ledger;"
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(done.stdout) == [], done.stderr


def test_public_names_load_on_use() -> None:
    import prefect_gpu_budget

    assert prefect_gpu_budget.GpuJob.__name__ == "GpuJob"
    assert set(prefect_gpu_budget.__all__) <= set(dir(prefect_gpu_budget))
    with pytest.raises(AttributeError):
        prefect_gpu_budget.NoSuchThing  # noqa: B018


def test_block_register_finds_every_block() -> None:
    """`prefect block register -m prefect_gpu_budget` registers what `inspect.getmembers` finds."""
    from prefect.blocks.core import Block

    import prefect_gpu_budget

    found = {
        name for name, cls in inspect.getmembers(prefect_gpu_budget) if Block.is_block_class(cls)
    }
    assert found == {
        "BillingExport",
        "CapacityPool",
        "DeploymentLauncher",
        "GpuBudget",
        "GpuPriorityClass",
        "SageMakerLauncher",
        "SpendLedger",
        "VertexLauncher",
    }


def test_collection_loader_registers_the_blocks() -> None:
    """Prefect's collection loader (run by servers, workers and `Block.load` by slug) makes the
    budget blocks known by their slugs in a fresh process."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from prefect.plugins import load_prefect_collections; load_prefect_collections();"
            "from prefect.blocks.core import Block;"
            "print(Block.get_block_class_from_key('gpu-budget').__name__,"
            " Block.get_block_class_from_key('gpu-spend-ledger').__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.stdout.split() == ["GpuBudget", "SpendLedger"], done.stderr[-2000:]


_TRIAL = """
import json, os, sys, time
time.sleep(0.2)
with open(os.environ["GPU_BUDGET_METRICS_FILE"], "a") as out:
    out.write(json.dumps({"summary": True, "loss": float(sys.argv[1])}) + "\\n")
"""


def test_sweep_command_runs_a_yaml_sweep_and_prints_its_table(prefect_api, prices, tmp_path):
    (tmp_path / "trial.py").write_text(_TRIAL)
    spec = {
        "name": "cli",
        "scope": "clisweep/team/a",
        "job": {"instance_type": "local:box", "max_runtime": "30s", "kill_grace": "1s"},
        "command": [sys.executable, str(tmp_path / "trial.py"), "{lr}"],
        "grid": {"lr": [0.5, 0.25, 0.125]},
        "parallelism": 3,
        "results_dir": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(spec))  # JSON is YAML
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    subprocess.run([*cli, "budget", "set", "clisweep", "--hourly-cap", "100"], env=env, check=True)
    subprocess.run(
        [*cli, "budget", "set", "clisweep/team", "--hourly-cap", "100", "--new"],
        env=env,
        check=True,
    )
    done = subprocess.run(
        [*cli, "sweep", str(tmp_path / "sweep.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["trial", "lr"])
    assert "state" in header and "cost_usd" in header
    rows = [line.split() for line in lines[lines.index(header) + 1 :] if line[:1] == " "]
    assert [r[0] for r in rows] == ["0", "1", "2"] and all("Completed" in r for r in rows), lines
    [results] = [line for line in lines if line.startswith("results: ")]
    assert (Path(results.split(": ", 1)[1]) / "trials.csv").is_file()

    listed = subprocess.run(
        [*cli, "ledger", "--json"], env=env, capture_output=True, text=True, check=True
    )
    jobs = json.loads(listed.stdout)
    assert sorted(j["name"] for j in jobs) == [f"{spec['name']}/000{i}" for i in range(3)]
    assert {j["outcome"] for j in jobs} == {"completed"} and all(j["flow_run_id"] for j in jobs)
    assert sorted((j["sweep"], j["trial"]) for j in jobs) == [(spec["name"], i) for i in range(3)]
    table = subprocess.run([*cli, "ledger"], env=env, capture_output=True, text=True, check=True)
    assert table.stdout.count("settled (completed)") == 3, table.stdout

    typo = tmp_path / "typo.yaml"
    typo.write_text(json.dumps({**spec, "paralelism": 2}))
    bad = subprocess.run([*cli, "sweep", str(typo)], env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: paralelism: unknown field; did you mean parallelism?"

    bad = subprocess.run(
        [*cli, "sweep", str(tmp_path / "missing.yaml")], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        f"error: spec: cannot read {tmp_path / 'missing.yaml'}: No such file or directory"
    ]


FIELD_CHANGES: list[tuple[list[str], str, object]] = [
    (["--hourly-cap", "123"], "hourly_cap_cents", 12_300),
    (["--period-budget", "10"], "period_budget_micro", 10_000_000),
    (["--period", "week"], "period", "week"),
    (["--timezone", "Europe/Berlin"], "timezone", "Europe/Berlin"),
    (["--on-limit", "reject"], "on_limit", "reject"),
    (["--max-wait", "2h"], "max_wait_s", 7200.0),
    (["--reservation-mode", "estimate"], "reservation_mode", "estimate"),
    (["--notify", "slack-webhook/ops"], "notify_block", "slack-webhook/ops"),
]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    with fresh_database(PG_URL) as fresh:
        yield fresh


def _cli_in_child(barrier, argv: list[str]) -> None:  # noqa: ANN001 - a multiprocessing Barrier
    from prefect_gpu_budget.cli import main

    sys.argv = ["prefect-gpu-budget", *argv]
    barrier.wait(timeout=120)
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    os._exit(code)


def _race(url: str, commands: list[list[str]]) -> list[int]:
    """Run each CLI command in its own process, all released at once; their exit codes."""
    import prefect_gpu_budget.cli  # noqa: F401 - imported once here, inherited by the children

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(commands))
    procs = [
        ctx.Process(target=_cli_in_child, args=(barrier, ["--ledger-url", url, *argv]))
        for argv in commands
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    return [proc.exitcode for proc in procs]


def _start(url: str) -> Ledger:
    ledger = Ledger(url)
    ledger.config.set_budget(
        GpuBudget(scope="acme", hourly_cap_usd=1000, period_budget_usd=1000).rule()
    )
    return ledger


def test_racing_budget_sets_each_keep_their_field(url: str) -> None:
    ledger = _start(url)
    try:
        codes = _race(url, [["budget", "set", "acme", *args] for args, _, _ in FIELD_CHANGES])
        assert codes == [0] * len(FIELD_CHANGES)
        [rule] = ledger.config.budgets()
        lost = {
            field: (getattr(rule, field), want)
            for _, field, want in FIELD_CHANGES
            if getattr(rule, field) != want
        }
        assert lost == {}, f"changes lost to a concurrent `budget set`: {lost}"
    finally:
        ledger.db.dispose()


def test_racing_session_template_sets_each_keep_their_field(url: str) -> None:
    ledger = Ledger(url)
    try:
        ledger.config.set_session_template(
            BudgetRule(scope="acme/agents", period_budget_micro=10**9)
        )
        codes = _race(
            url,
            [
                ["budget", "set", "acme/agents", "--session-template", *args]
                for args, _, _ in FIELD_CHANGES
            ],
        )
        assert codes == [0] * len(FIELD_CHANGES)
        [rule] = ledger.config.session_templates()
        lost = {f: getattr(rule, f) for _, f, want in FIELD_CHANGES if getattr(rule, f) != want}
        assert lost == {}, f"changes lost to a concurrent `budget set`: {lost}"
    finally:
        ledger.db.dispose()


def test_racing_quotas_and_pool_set_all_survive(url: str) -> None:
    ledger = Ledger(url)
    try:
        pool = ["pool", "set", "acme", "lab", "--nodes", "4", "--gpus-per-node", "8"]
        assert _race(url, [pool]) == [0]
        teams = [f"team-{i}" for i in range(6)]
        commands = [
            ["pool", "quota", f"acme/{team}", "--pool", "lab", "--gpus", str(i + 1)]
            for i, team in enumerate(teams)
        ]
        commands.append([*pool, "--gpu-model", "h100"])  # the pool changes while quotas land
        assert _race(url, commands) == [0] * len(commands)
        [lab], quotas = ledger.config.capacity("acme")
        assert {q.team: q.quota[0] for q in quotas} == {
            f"acme/{team}": i + 1 for i, team in enumerate(teams)
        }
        assert lab.gpu_model == "h100"
    finally:
        ledger.db.dispose()


def test_a_bad_value_in_the_merged_rule_writes_nothing(tmp_path: Path, monkeypatch, capsys):
    from prefect_gpu_budget.cli import main

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = _start(url)
    before = ledger.config.budgets()
    # removing the only two limits is checked against the rule as it stands in the ledger
    argv = ["budget", "set", "acme", "--hourly-cap", "none", "--period-budget", "none"]
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: budget:") and "\n" not in err
    assert ledger.config.budgets() == before


def _cli_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mistakes_are_caught_with_did_you_mean(tmp_path):
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    assert _cli_run(env, "budget", "set", "acme", "--hourly-cap", "60").returncode == 0
    assert _cli_run(env, "budget", "set", "acme/vision", "--hourly-cap", "20").returncode == 0
    typo = _cli_run(env, "budget", "set", "acme/visoin/agent-7", "--hourly-cap", "5")
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "error: scope: acme/visoin has no budget; did you mean acme/vision? (--new creates it)"
    )
    assert {r.scope for r in Ledger(env["PREFECT_GPU_BUDGET_LEDGER_URL"]).config.budgets()} == {
        "acme",
        "acme/vision",
    }  # nothing written
    org_typo = _cli_run(env, "budget", "set", "acne", "--hourly-cap", "5")
    assert org_typo.returncode == 2 and "did you mean acme?" in org_typo.stderr
    forced = _cli_run(env, "budget", "set", "acme/visoin/agent-7", "--hourly-cap", "5", "--new")
    assert forced.returncode == 0, forced.stderr
    # a session of a known team, and a new team far from any other, need no --new
    assert (
        _cli_run(env, "budget", "set", "acme/vision/agent-8", "--hourly-cap", "5").returncode == 0
    )
    assert _cli_run(env, "budget", "set", "acme/robotics", "--hourly-cap", "5").returncode == 0

    status = _cli_run(env, "status", "acme/visio")
    assert status.returncode == 2
    assert status.stderr.strip().endswith("in acme/visio; did you mean acme/vision?")
    ledger = _cli_run(env, "ledger", "zzz")
    assert ledger.returncode == 2 and "known: acme" in ledger.stderr
    assert _cli_run(env, "status", "acme/vision").returncode == 0


@pytest.mark.parametrize("argv", [[], ["budget"], ["pool"]], ids=["bare", "budget", "pool"])
def test_a_command_named_alone_prints_its_help_and_no_traceback(tmp_path, argv):
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    done = _cli_run(env, *argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "Usage: " in done.stdout and "Commands" in done.stdout


def test_cancel_ends_a_queued_job_and_stops_a_running_one_as_scancel(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url}
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("sc", hourly_cap_cents=360))
    running, _ = ledger.queue.request(new_job("sc/s"))
    assert ledger.settlements.mark_started(running, time.time())
    queued, waits = ledger.queue.request(new_job("sc/s"))
    assert waits.verdict == "wait"
    before = ledger.views.jobs()
    for wrong, said in (
        ("", "no job"),
        ("zzz", "no job zzz"),
        ("%", "no job %"),
    ):
        done = _cli_run(env, "cancel", queued[:8], wrong)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert ledger.views.jobs() == before  # a bad id anywhere stops nothing
    done = _cli_run(env, "cancel", queued[:8], running[:8], "--reason", "runaway sweep")
    assert done.returncode == 0, done.stderr
    assert f"{queued[:8]} sc/s: cancelled" in done.stdout
    assert f"{running[:8]} sc/s: stopping" in done.stdout
    rows = {r["id"]: r for r in ledger.views.jobs()}
    assert rows[queued]["state"] == "cancelled" and rows[queued]["reason"] == "runaway sweep"
    assert rows[running]["stop_asked_at"] is not None  # its holder stops and settles it
    again = _cli_run(env, "cancel", queued)
    assert again.returncode == 2 and "has ended (cancelled)" in again.stderr, again.stderr
    ledger.db.dispose()


def test_a_child_cap_above_its_parents_is_set_with_a_warning(tmp_path):
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    assert _cli_run(env, "budget", "set", "acme", "--hourly-cap", "60").returncode == 0
    done = _cli_run(env, "budget", "set", "acme/vision", "--hourly-cap", "500")
    assert done.returncode == 0
    assert done.stderr.strip() == (
        "warning: the cap $500.00/h of acme/vision is above the $60.00/h of acme, which binds"
    )
    assert "budget set for acme/vision: cap $500.00/h" in done.stdout  # one line when piped


def test_a_cap_that_is_not_whole_cents_is_set_with_a_warning(tmp_path):
    """Caps are whole cents per hour, rounded down: a finer cap is kept lower, said in one
    line; one under a cent admits nothing, and says so. A whole-cent cap says nothing."""
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    done = _cli_run(env, "budget", "set", "acme", "--hourly-cap", "3.605")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "warning: the cap $3.605/h of acme is kept as $3.60/h "
        "(caps are whole cents per hour, rounded down)"
    )
    done = _cli_run(env, "budget", "set", "acme/tiny", "--hourly-cap", "0.004", "--new")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "warning: the cap $0.004/h of acme/tiny is kept as $0.00/h (caps are whole cents per "
        "hour, rounded down): no job will be admitted in it"
    )
    done = _cli_run(env, "budget", "set", "acme", "--hourly-cap", "3.61")
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


def test_the_ledger_names_why_a_job_that_never_ran_ended(tmp_path, monkeypatch, capsys):
    from prefect_gpu_budget.cli import main
    from tests.jobs import new_job

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=100, on_limit="reject"))
    refused, decision = ledger.queue.request(new_job("acme/t", name="nightly/0007"))
    assert decision.verdict == "reject"
    monkeypatch.setenv("PREFECT_GPU_BUDGET_LEDGER_URL", url)
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "ledger", "--json"])
    main()
    [row] = json.loads(capsys.readouterr().out)
    assert (row["id"], row["outcome"], row["sweep"], row["trial"]) == (
        refused,
        "refused",
        "nightly",
        7,
    )


def test_quote_prices_a_part_of_a_machine_by_its_largest_share() -> None:
    env = dict(os.environ)
    out = _cli_run(env, "quote", "aws:p5.48xlarge", "--gpus", "2", "--vcpu", "96")
    assert out.returncode == 0, out.stderr
    assert "$27.52/h  1/2 of each node's price" in out.stdout  # 96 of 192 vCPU binds
    whole = _cli_run(env, "quote", "aws:p5.48xlarge", "--gpus", "8")
    assert "$55.04/h  8x H100 80GB per node" in whole.stdout
    too_big = _cli_run(env, "quote", "aws:p5.48xlarge", "--gpus", "9")
    assert too_big.returncode == 2
    assert too_big.stderr.strip() == "error: gpus: asks 9 GPUs, but aws:p5.48xlarge has 8"


_QUOTE_PROBE = """
import sys
from prefect_gpu_budget.cli import main
sys.argv = ["prefect-gpu-budget", "quote", "aws:g5.xlarge"]
try:
    main()
except SystemExit:
    pass
print("pydantic" in sys.modules, file=sys.stderr)
"""


def _shipped_prices(tmp_path: Path) -> dict[str, str]:
    """The environment of a CLI that reads the shipped catalog only."""
    return {
        **os.environ,
        "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "prices.csv"),
        "PREFECT_GPU_BUDGET_CATALOG_DIR": str(tmp_path / "catalogs"),
        "COLUMNS": "300",
    }


def test_quote_prices_a_part_as_the_gate_does_and_a_whole_machine_quickly(tmp_path) -> None:
    """Issue 31, point 7: `quote --gpus 1` of an 8-GPU machine is what the gate charges (1/8 of
    its price, to the micro-dollar; `pricing.catalog.price_job`); a whole machine's quote
    still loads no job model (pydantic)."""
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import SHIPPED, Catalog, _read

    env = _shipped_prices(tmp_path)
    part = _cli_run(env, "quote", "aws:p4d.24xlarge", "--gpus", "1")
    assert part.returncode == 0, part.stderr
    assert "x1: $2.74475/h  1/8 of each node's price (of 8x A100 40GB per node)" in part.stdout
    gate = Gate(None, catalog=Catalog(_read(SHIPPED)))  # pricing reads no ledger
    job = GpuJob(instance_type="aws:p4d.24xlarge", gpus=1, max_runtime="1h")
    assert gate.quote(job).rate_micro_per_hour == 2_744_750
    done = subprocess.run(
        [sys.executable, "-c", _QUOTE_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.startswith("aws:g5.xlarge (on-demand) x1: $1.006/h"), done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_quote_of_flex_start_without_a_figure_says_it_is_an_upper_bound(tmp_path) -> None:
    """Issue 31, point 8: flex-start with no recorded figure is quoted at the on-demand price,
    said to be an upper bound; with no on-demand figure either, it is refused (exit 2)."""
    env = _shipped_prices(tmp_path)
    done = _cli_run(env, "quote", "gcp:g2-standard-4", "--provisioning", "flex-start")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gcp:g2-standard-4 (flex-start) x1: $0.7068/h (upper bound)")
    assert (
        "upper bound: on-demand price; flex-start is billed at its own discounted rate"
        in done.stdout
    )
    refused = _cli_run(env, "quote", "gcp:a3-highgpu-8g", "--provisioning", "flex-start")
    assert refused.returncode == 2 and "no public figure recorded" in refused.stderr
