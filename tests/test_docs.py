"""The manual (`docs/`, MkDocs with the Material theme) and the README beside it: the site builds
in strict mode (a broken link, a page missing from the nav or a failing reference fails), the
README stays short, every line fits 100 columns, and every block a reader would paste is
either run by a test (its `<!-- tested: NAME -->` marker read by one) or fenced as output.

`tests/test_readme.py` runs the tour's, the agents' and the forecast's blocks. The others are
checked here, as far as a test can without a cloud, a second host or minutes of work: a shell
block parses (`bash -n`) and each `prefect-gpu-budget` command in it names a real command whose
arguments and options parse as the command line would parse them; a Python block compiles and
its imports resolve (the blocks that only define a flow or a task are run whole); JSON loads;
a benchmark's command names a module of `benchmarks/` and options it reads.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MARKED = re.compile(r"<!-- tested: ([\w-]+)\b[^>]*-->\n```(\w*)\n(.*?)\n```\n", re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)\n```$", re.S | re.M)
PASTED = {"bash", "sh", "shell", "python", "py", "yaml", "yml", "toml", "json"}
"""What a reader pastes: each such block carries a marker that a test reads."""
OUTPUT = {"text", "console", "output"}
"""Output or illustration: printed by a command, never pasted."""
RUN_ELSEWHERE = {
    "quick-start": "tests/test_readme.py",
    "sweep-spec": "tests/test_readme.py",
    "sweep-train": "tests/test_readme.py",
    "sweep-run": "tests/test_readme.py",
    "agent-admin": "tests/test_readme.py",
    "agent-loop": "tests/test_readme.py",
    "mcp-client": "tests/test_readme.py",
    "demo-forecast": "tests/test_readme.py",
    "pool-commands": "tests/test_docs.py",
    "placement-quote": "tests/test_docs.py",
}
CHECKED = [
    "install-demo",
    "install-test",
    "server-start",
    "python-job",
    "gpu-sweep",
    "serve",
    "mcp-config",
    "gpu-task",
    "job-defaults",
    "work-pool",
    "vertex-launcher",
    "bill-commands",
    "lease-storage",
    "hosts-databases",
    "hosts-redis-dbs",
    "hosts-replicas",
    "hosts-clients",
    "hosts-trial",
    "forecast-plot",
    "bench-gate-latency",
    "bench-cli-latency",
    "bench-fidelity",
    "bench-deep-queue",
    "bench-placement",
    "placement-job",
]
"""The blocks this file checks (the module's docstring says how)."""
DEFINES = {
    "python-job": [],
    "gpu-task": [],
    "job-defaults": ["gpu-task"],
    "placement-job": [],
}
"""Python blocks run whole (they only define), after the blocks they build on."""


def _marked() -> dict[str, tuple[Path, str, str]]:
    found: dict[str, tuple[Path, str, str]] = {}
    for page in PAGES:
        for name, language, text in MARKED.findall(page.read_text()):
            assert name not in found, f"{name} is marked twice: {found[name][0]} and {page}"
            found[name] = (page, language, text)
    return found


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """`mkdocs build --strict`: no warning (a broken link or anchor, a page left out of the nav,
    a snippet not found), and the generated references hold every command and block."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = built.stdout + built.stderr
    assert built.returncode == 0, said[-5000:]
    assert not re.search(r"^(WARNING|ERROR)\b", said, re.M), said[-5000:]
    cli = (tmp_path / "s" / "reference" / "cli" / "index.html").read_text()
    for command in ("budget set", "agents serve", "bill import", "pool quota", "sweep"):
        assert f"prefect-gpu-budget {command}" in cli, command
    blocks = (tmp_path / "s" / "reference" / "blocks" / "index.html").read_text()
    import prefect_gpu_budget.blocks as public

    for name in public.__all__:
        assert name in blocks, name
    assert "hourly_cap" in blocks


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_no_line_is_over_100_characters() -> None:
    """The README and the manual read in a 100-column editor or terminal: prose wrapped, wide
    tables written as lists, long commands split with `\\` continuations."""
    long = [
        f"{page.relative_to(ROOT)}:{n} ({len(line)})"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert not long, f"lines over 100 characters: {', '.join(long)}"


def test_every_block_a_reader_pastes_is_tested_or_output() -> None:
    """A pasted block carries a marker that a test in tests/ reads; any other is fenced as
    output (`text`, `console`); a block with no language says neither, and fails."""
    marked = _marked()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    unmarked = []
    for page in PAGES:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            language = fence.group(1)
            if language in OUTPUT:
                continue
            before = text[: fence.start()].rstrip("\n").rsplit("\n", 3)
            is_marked = "<!-- tested: " in "\n".join(before[-3:]) and before[-1].endswith("-->")
            if language not in PASTED or not is_marked:
                line = text[: fence.start()].count("\n") + 1
                unmarked.append(f"{page.relative_to(ROOT)}:{line} ({language or 'no language'})")
    assert not unmarked, f"blocks neither tested nor fenced as output: {unmarked}"
    for name in marked:
        assert f'"{name}"' in tests, f"no test reads the block marked {name}"
    for name, where in RUN_ELSEWHERE.items():
        assert name in marked and f'"{name}"' in (ROOT / where).read_text(), (name, where)
    assert set(marked) == set(RUN_ELSEWHERE) | set(CHECKED), set(marked) ^ (
        set(RUN_ELSEWHERE) | set(CHECKED)
    )


# the checks of the blocks no other test runs


def _root_command() -> click.Group:
    import typer

    from prefect_gpu_budget.cli import app

    return typer.main.get_command(app)


def _invocations(script: str, program: str) -> list[list[str]]:
    """Each call of `program` in a shell script, as its arguments (continuations joined,
    comments dropped, ended at `&`, `;`, `|`, `)`)."""
    calls = []
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for n, word in enumerate(words):
            if word.endswith(program) and word.rsplit("/", 1)[-1].lstrip("$(") == program:
                args = []
                for arg in words[n + 1 :]:
                    if arg in {"&", "&&", ";", "|", "||", ")", ">", "2>&1"} or arg.endswith(")"):
                        if arg.endswith(")") and arg != ")":
                            args.append(arg.rstrip(")"))
                        break
                    args.append(arg)
                calls.append(args)
    return calls


def _parse(root: click.Group, args: list[str]) -> None:
    """Parse `args` as `prefect-gpu-budget ARGS` would, without running the command."""
    command: click.Command = root
    ctx = None
    path = ["prefect-gpu-budget"]
    rest = list(args)
    while isinstance(command, click.Group):
        while rest and rest[0].startswith("-"):  # the group's own options
            rest = rest[2:] if rest[0] == "--ledger-url" else rest[1:]
        assert rest, f"{' '.join(path)} needs a command"
        ctx = click.Context(command, info_name=path[-1], parent=ctx)
        sub = command.get_command(ctx, rest[0])
        assert sub is not None, f"no command {' '.join([*path, rest[0]])}"
        path.append(rest.pop(0))
        command = sub
    with command.make_context(path[-1], rest, parent=ctx) as parsed:
        assert parsed.params is not None


@pytest.mark.parametrize("name", CHECKED)
def test_the_checked_block_holds(name: str) -> None:
    page, language, text = _marked()[name]
    if language == "bash":
        parsed = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert parsed.returncode == 0, (name, parsed.stderr)
        root = _root_command()
        for args in _invocations(text, "prefect-gpu-budget"):
            try:
                _parse(root, args)
            except click.ClickException as refused:
                pytest.fail(f"{name}: prefect-gpu-budget {shlex.join(args)}: {refused}")
        for module, args in re.findall(r"python -m (benchmarks\.\w+)([^\n#]*)", text):
            source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
            for option in re.findall(r"--[\w-]+", args):
                assert f'"{option}"' in source, (name, module, option)
    elif language == "python":
        tree = ast.parse(text)
        if name in DEFINES:
            namespace: dict[str, object] = {}
            for first in DEFINES[name]:
                exec(compile(_marked()[first][2], first, "exec"), namespace)
            exec(compile(text, name, "exec"), namespace)
        else:
            imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            exec(compile(ast.Module(body=imports, type_ignores=[]), name, "exec"), {})
    elif language == "json":
        config = json.loads(text)
        assert config["mcpServers"]["gpu-budget"]["url"].endswith("/mcp"), config
    else:
        pytest.fail(f"{name}: no check for {language}")
    _special(name, text)


def _special(name: str, text: str) -> None:
    """What a block names beyond the command line: the CI's command, a module path."""
    if name == "install-test":
        ci = (ROOT / ".ci" / "run").read_text()
        assert ".venv/bin/python -m pytest -q\n" in ci and '-e ".[test]"' in ci
        assert text.endswith(".venv/bin/python -m pytest -q"), text
    if name == "lease-storage":
        import importlib

        importlib.import_module(text.split("=", 1)[1].strip())


def test_the_pool_and_placement_blocks_run_as_written(tmp_path: Path) -> None:
    """The pools' commands, then the placement quotes, in bash as a user pastes them, on a
    ledger, a prices file and a Prefect home of their own (no Prefect API: the pools are the
    only offerings, and the quotes say so)."""
    pools, placing = _marked()["pool-commands"][2], _marked()["placement-quote"][2]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
        "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "prices.csv"),
    }
    env.pop("PREFECT_API_URL", None)
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", f"{pools}\n{placing}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    said = " ".join(ran.stdout.split())
    assert "0 of 16 accelerators in use" in said
    assert "chosen: local:h100x8 on-demand (lab-a), reserving $160." in said  # 4 h at $40/h
    offers = json.loads(ran.stdout[ran.stdout.index("[\n") :])
    assert [o["offering"] for o in offers if o["chosen"]] == ["local:h100x8 on-demand (lab-a)"]
