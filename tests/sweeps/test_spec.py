"""A sweep's spec (`SweepSpec`): its trials, its random draws and seed, YAML, one-line errors."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from prefect_gpu_budget.job import one_line
from prefect_gpu_budget.sweeps.spec import SweepSpec


def _spec(tmp_path, **overrides) -> SweepSpec:
    fields = {
        "name": "unit",
        "scope": "lab/sweeps/agent-1",
        "job": {"instance_type": "local:box", "max_runtime": "30s", "kill_grace": "1s"},
        "command": [sys.executable, str(tmp_path / "trial.py"), "{lr}", "{width}"],
        "grid": {"lr": [0.1, 0.5, 2.0], "width": [4, 8]},
        "parallelism": 3,
        "results_dir": str(tmp_path / "results"),
    }
    fields.update(overrides)
    return SweepSpec.model_validate(fields)


def test_random_search_is_repeatable(tmp_path):
    spec = _spec(
        tmp_path,
        grid={},
        random={"lr": {"low": 1e-4, "high": 1e-1, "log": True}, "width": {"choices": [4, 8, 16]}},
        samples=5,
        seed=3,
    )
    first, again = spec.trials(), spec.trials()
    assert first == again and len(first) == 5
    assert all(1e-4 <= t["lr"] <= 1e-1 and t["width"] in (4, 8, 16) for t in first)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"name": "Bad Name"}, "name"),
        ({"scope": "lab/../x"}, "scope"),
        ({"command": None}, "command"),
        ({"command": ["python", "{missing}"]}, "command"),
        ({"command": ["python", "{}"]}, "command"),
        ({"command": ["python", "{0}"]}, "command"),
        ({"command": ["python", "{lr.real}"]}, "command"),
        ({"command": ["python", "{lr"]}, "command"),
        ({"callable": "mod:fn\n", "command": None}, "callable"),
        ({"grid": {"lr\n": [1]}}, "grid"),
        ({"grid": {"lr": []}}, "grid"),
        ({"grid": {"bad-name": [1]}}, "grid"),
        ({"grid": {"a": list(range(200)), "b": list(range(200))}}, "grid"),
        ({"random": {"dropout": {"low": 1, "high": 0}}, "samples": 2}, "random"),
        ({"random": {"dropout": {"low": 0.1, "high": 1}}}, "samples"),
        ({"random": {"lr": {"choices": [1]}}, "samples": 1}, "random"),
        ({"job": {"instance_type": "local:box"}}, "job"),
        ({"job": {"instance_type": "local:box", "max_runtime": "1 week"}}, "max_runtime"),
        ({"parallelism": 0}, "parallelism"),
        ({"callable": "not a callable", "command": None}, "callable"),
    ],
)
def test_bad_specs_get_one_line_errors(tmp_path, overrides, field):
    with pytest.raises(ValidationError) as exc:
        _spec(tmp_path, **overrides)
    message = one_line(exc.value)
    assert "\n" not in message and field in message, message


def test_yaml_spec(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "name: nightly\nscope: lab/sweeps\njob: {instance_type: 'local:box', max_runtime: 1h}\n"
        "callable: mypkg.train:run\ngrid: {lr: [0.1, 0.2]}\n"
    )
    spec = SweepSpec.from_yaml(path)
    assert [t["lr"] for t in spec.trials()] == [0.1, 0.2]
    path.write_text("name: [unclosed\n")
    with pytest.raises(Exception, match="not valid YAML"):
        SweepSpec.from_yaml(path)


def test_random_draws_differ_per_spec_unless_seeded(tmp_path):
    dims = {"lr": {"low": 1e-4, "high": 1e-1, "log": True}, "width": {"choices": [4, 8]}}
    one, two = (_spec(tmp_path, grid={}, random=dims, samples=4) for _ in range(2))
    assert one.seed is not None and one.seed != two.seed  # 2**31 seeds: equal by chance ~never
    assert one.trials() != two.trials()
    again = _spec(tmp_path, grid={}, random=dims, samples=4, seed=one.seed)
    assert again.trials() == one.trials()
