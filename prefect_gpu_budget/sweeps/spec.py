"""What a sweep is: the spec a `gpu_sweep` runs (`SweepSpec`, its `JobShape` and `RandomParam`).

A model, not a flow: it imports no Prefect, so the forecast, the CLI and the flows can all read a
spec without one another. `prefect_gpu_budget.sweeps.flow` re-exports these names.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import secrets
import string
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefect_gpu_budget.admission.admin_settings import Scope
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.units import BudgetInputError, near, shown

Scalar = str | int | float | bool
MAX_TRIALS = 10_000
MAX_FORMAT_WIDTH = 64
"""Largest width or precision a placeholder's format spec may ask for (`{lr:.6g}` is fine)."""
MAX_ARGUMENT = 128 * 1024
"""The longest one argument of a trial's command may grow: Linux's MAX_ARG_STRLEN."""
MAX_COMMAND = 1024 * 1024
"""The longest a trial's whole command may grow (Linux allows 2 MiB with the environment)."""
_NAME_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_PARAM_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def _known_keys(model: type[BaseModel], data: object) -> object:
    """Refuse a key the model does not have, naming the nearest one (a YAML typo)."""
    if isinstance(data, dict):
        for key in data:
            if key not in model.model_fields:
                close = near(str(key), model.model_fields, most=3)
                hint = (
                    f"did you mean {close[0]}?"
                    if close
                    else "known: " + ", ".join(model.model_fields)
                )
                raise BudgetInputError(str(key)[:64], f"unknown field; {hint}")
    return data


class JobShape(BaseModel):
    """The GPU job every trial runs as (see `GpuJob`)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: object) -> object:
        return _known_keys(cls, data)

    instance_type: str = ""
    """Left out when the trials ask for `accelerators`: each is placed when it starts."""
    accelerators: str | None = None
    deadline: str | float | None = None
    checkpoint: str | None = None
    max_runtime: str | float
    nodes: int = 1
    provisioning: Literal["on-demand", "spot", "flex-start"] = "on-demand"
    expected_runtime: str | float | None = None
    priority: str | int = 0
    max_wait: str | float | None = None
    on_limit: Literal["queue", "reject"] | None = None
    kill_grace: str | float = 10.0
    gpus: int | None = None
    vcpu: int | None = None
    memory_gib: int | None = None


class RandomParam(BaseModel):
    """A random dimension: `choices`, or a range `low`..`high` (`log` for log-uniform)."""

    model_config = ConfigDict(extra="forbid")

    choices: list[Scalar] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False

    @model_validator(mode="after")
    def _check(self) -> RandomParam:
        if self.choices is not None:
            if not self.choices:
                raise ValueError("choices must not be empty")
            return self
        if (
            self.low is None
            or self.high is None
            or not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high)
        ):
            raise ValueError("needs choices, or finite low < high")
        if self.log and self.low <= 0:
            raise ValueError("log needs low > 0")
        return self

    def draw(self, rng: random.Random) -> Scalar:
        if self.choices is not None:
            return rng.choice(self.choices)
        assert self.low is not None and self.high is not None
        if self.log:
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        return round(value) if self.integer else float(f"{value:.6g}")


class SweepSpec(BaseModel):
    """What to sweep, how each trial runs, and under which budget scope."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: object) -> object:
        return _known_keys(cls, data)

    name: str = Field(pattern=_NAME_RE)
    scope: Scope
    job: JobShape
    command: list[str] | None = Field(
        None, description="Trial command; `{param}` placeholders are filled per trial."
    )
    callable: str | None = Field(None, description="`module:function` called with the parameters.")
    grid: dict[str, list[Scalar]] = Field(default_factory=dict)
    random: dict[str, RandomParam] = Field(default_factory=dict)
    samples: int = Field(0, ge=0, le=MAX_TRIALS)
    seed: int | None = Field(
        None,
        ge=0,
        description="Seed of the random draws; by default a new one per spec, so that runs "
        "explore different points (the seed drawn is kept on the spec and in the summary).",
    )
    parallelism: int = Field(4, ge=1, le=256)
    metric: str = "loss"
    goal: Literal["min", "max"] = "min"
    results_dir: str = "gpu-budget-results"
    launcher: str | None = Field(
        None,
        pattern=r"^(vertex|sagemaker|deployment):[a-z0-9][a-z0-9-]{0,99}$",
        description="A saved launcher block as 'vertex:NAME', 'sagemaker:NAME' or "
        "'deployment:NAME'; default: local processes.",
    )

    @model_validator(mode="after")
    def _check(self) -> SweepSpec:
        if self.seed is None:
            self.seed = secrets.randbelow(2**31)
        if (self.command is None) == (self.callable is None):
            raise BudgetInputError("command", "give exactly one of command or callable")
        if self.callable is not None and not re.fullmatch(r"[\w.]+:\w+", self.callable):
            raise BudgetInputError(
                "callable", f"must be 'module:function', got {shown(self.callable)}"
            )
        names = [*self.grid, *self.random]
        for name in names:
            if not _PARAM_RE.fullmatch(name):
                raise BudgetInputError(
                    "grid", f"parameter names must be identifiers, got {shown(name)}"
                )
        if len(set(names)) != len(names):
            raise BudgetInputError("random", "a parameter is both in grid and random")
        for name, values in self.grid.items():
            if not values:
                raise BudgetInputError("grid", f"{name} has no values")
        if self.random and self.samples == 0:
            raise BudgetInputError("samples", "random parameters need samples >= 1")
        size = math.prod(len(v) for v in self.grid.values()) * max(1, self.samples)
        if size > MAX_TRIALS:
            raise BudgetInputError("grid", f"{size} trials; at most {MAX_TRIALS}")
        for part in self.command or []:
            _check_command_part(part, names)
        self._check_expansion()
        self.job_for({name: 0 for name in names}, "check")  # the job shape validates now
        return self

    def _check_expansion(self) -> None:
        """No trial's command can grow past what the kernel takes (`MAX_ARGUMENT`,
        `MAX_COMMAND`): `{a}` repeated 10,900 times over a 31 kB value is 337 MB per trial,
        built again by every forecast, from a 64 kB spec."""
        longest: dict[str, int] = {
            name: max(len(str(v)) for v in vs) for name, vs in self.grid.items()
        }
        for name, dim in self.random.items():
            longest[name] = max(len(str(v)) for v in dim.choices) if dim.choices else 32
        total = 0
        for part in self.command or []:
            size = 0
            for literal, field, spec, _ in string.Formatter().parse(part):
                size += len(literal)
                if field is not None:
                    widths = [int(n) for n in re.findall(r"\d+", spec or "")]
                    size += max([longest[field], *widths])
            if size > MAX_ARGUMENT:
                raise BudgetInputError(
                    "command",
                    f"{shown(part)} grows to {size:,} characters in a trial; at most "
                    f"{MAX_ARGUMENT:,} per argument",
                )
            total += size
        if total > MAX_COMMAND:
            raise BudgetInputError(
                "command", f"grows to {total:,} characters in a trial; at most {MAX_COMMAND:,}"
            )

    @classmethod
    def from_yaml(cls, path: str | Path) -> SweepSpec:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise BudgetInputError("spec", f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise BudgetInputError(
                "spec", f"{path} is not valid YAML: {str(exc).splitlines()[0]}"
            ) from None
        if not isinstance(data, dict):
            raise BudgetInputError("spec", f"{path} must hold a mapping of sweep fields")
        return cls.model_validate(data)

    def params(self) -> list[str]:
        return [*self.grid, *self.random]

    def trials(self) -> list[dict[str, Scalar]]:
        grid = [
            dict(zip(self.grid, values, strict=True))
            for values in itertools.product(*self.grid.values())
        ]
        if not self.random:
            return grid
        rng = random.Random(self.seed)
        return [
            {**point, **{name: dim.draw(rng) for name, dim in self.random.items()}}
            for point in grid
            for _ in range(self.samples)
        ]

    def job_for(self, params: dict[str, Scalar], name: str, grant: str | None = None) -> GpuJob:
        if self.command is not None:
            command = [part.format(**params) for part in self.command]
        else:
            command = [
                sys.executable,
                "-m",
                "prefect_gpu_budget.sweeps.trial",
                str(self.callable),
                json.dumps(params),
            ]
        return GpuJob(
            **self.job.model_dump(exclude_none=True), command=command, name=name, grant=grant
        )


def preflight(spec: SweepSpec, launcher: Any) -> None:
    """Refuse, before anything starts, what would stop every trial of the sweep: an instance
    type without a price (with did-you-mean), or a job its launcher cannot run (a type it does
    not run, a command not there): a `BudgetInputError` naming the field. The checks `forecast`
    makes and the first trial would make, for `sweep`, the agent gateway and the agent flow."""
    from prefect_gpu_budget.admission.prices import price_job
    from prefect_gpu_budget.launchers.base import LaunchConfigError

    trials = spec.trials()
    job = spec.job_for(trials[0] if trials else {}, spec.name)
    if not job.placed:  # each trial is placed when it starts: its accelerators must exist
        from prefect_gpu_budget.admission.prices import default_catalog
        from prefect_gpu_budget.placement.accelerators import matching, parse_accelerators

        matching(parse_accelerators(job.accelerators), default_catalog().rows())
        return
    try:
        launcher.preflight(job, price_job(job)[0])
    except LaunchConfigError as refused:
        field, sep, rest = refused.reason.partition(": ")
        if sep and re.fullmatch(r"[a-z_]+", field):  # the launcher named the field
            raise BudgetInputError(
                "job.instance_type" if field == "instance_type" else field, rest
            ) from None
        raise BudgetInputError(
            "command" if refused.launcher == "local" else "launcher", refused.reason
        ) from None


def load_spec(spec: SweepSpec | dict[str, Any] | str, scope: str | None = None) -> SweepSpec:
    """A spec from a model, a mapping or a YAML path; `scope` re-homes it (an agent's session)."""
    if isinstance(spec, str):
        spec = SweepSpec.from_yaml(spec)
    elif not isinstance(spec, SweepSpec):
        spec = SweepSpec.model_validate(spec)
    if scope is not None and scope != spec.scope:
        spec = SweepSpec.model_validate({**spec.model_dump(), "scope": scope})
    return spec


def _check_command_part(part: str, names: list[str]) -> None:
    """One part of a spec's command: its braces parse, no format spec nests a field or asks
    for a width past MAX_FORMAT_WIDTH, and each placeholder names a parameter."""
    try:
        parsed = [(f, spec) for _, f, spec, _ in string.Formatter().parse(part)]
    except ValueError as exc:
        raise BudgetInputError(
            "command", f"{exc} in {shown(part)} (write {{{{ and }}}} for literal braces)"
        ) from None
    used = [field for field, _ in parsed if field is not None]
    for _, spec in parsed:  # `{lr:>400000000}` would build a 400 MB argument
        if spec and (
            "{" in spec or any(int(n) > MAX_FORMAT_WIDTH for n in re.findall(r"\d+", spec))
        ):
            raise BudgetInputError(
                "command",
                f"format spec {shown(spec)} in {shown(part)}: no nested fields, and "
                f"widths and precisions at most {MAX_FORMAT_WIDTH}",
            )
    for field in used:  # `{}`, `{0}`, `{lr.real}`: only a parameter's name fills in
        if field not in names:
            raise BudgetInputError(
                "command",
                f"unknown placeholder {{{field}}} in {shown(part)}; placeholders name "
                f"parameters ({', '.join(names) or 'none given'}), "
                "and {{ }} write literal braces",
            )
