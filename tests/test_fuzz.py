"""Hostile and malformed input, generated: every request model either accepts a value or refuses
it with one line naming the field; nothing else escapes."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from prefect_gpu_budget.admission.limits import limit_name
from prefect_gpu_budget.blocks import GpuBudget
from prefect_gpu_budget.job import GpuJob, one_line
from prefect_gpu_budget.sweeps.spec import SweepSpec
from prefect_gpu_budget.units import BudgetInputError, validate_scope

HOSTILE_TEXT = st.one_of(
    st.text(max_size=300),
    st.sampled_from(
        [
            "../../etc/passwd",
            "a/../b",
            "acme/./x",
            "acme//x",
            "'; DROP TABLE gpu_jobs; --",
            "аcme",
            "acme\u200b",
            "ACME",
            "a" * 10_000,
            "acme:team",
            "acme%2Fteam",
            "acme/team/",
            "1e309",
            "-0",
            "0x10",
            "9" * 400,
            "NaN",
            "-inf",
            "1h-30m",
            "3 fortnights",
            "\x00",
        ]
    ),
)
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    HOSTILE_TEXT,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def _refused_cleanly(exc: BaseException, fields: set[str]) -> None:
    message = one_line(exc)
    assert "\n" not in message and len(message) < 600, message
    assert any(message.startswith(f) for f in fields), message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(GpuJob.model_fields)), ANY_VALUE, max_size=6))
def test_gpu_job_accepts_or_refuses_in_one_line(fields):
    fields = {"instance_type": "aws:g5.xlarge", "max_runtime": "1h", **fields}
    try:
        job = GpuJob(**fields)
    except ValidationError as exc:
        _refused_cleanly(exc, set(GpuJob.model_fields))
    else:
        assert 0 < job.max_runtime <= 30 * 86400 and math.isfinite(job.max_runtime)
        assert 1 <= job.nodes <= 1024


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(sorted(set(GpuBudget.model_fields) - {"block_document_name"})),
        ANY_VALUE,
        max_size=6,
    )
)
def test_budget_accepts_or_refuses_in_one_line(fields):
    fields = {"scope": "acme", **fields}
    try:
        budget = GpuBudget(**fields)
    except ValidationError as exc:
        _refused_cleanly(exc, set(GpuBudget.model_fields))
    else:
        rule = budget.rule()  # exact integer units, inside 64 bits
        for amount in (rule.hourly_cap_cents, rule.period_budget_micro):
            assert amount is None or 0 <= amount < 2**63


@settings(max_examples=500, deadline=None)
@given(st.lists(HOSTILE_TEXT, min_size=2, max_size=8))
def test_scopes_never_collide_as_concurrency_limit_names(candidates):
    accepted = {}
    for text in candidates:
        try:
            scope = validate_scope(text)
        except BudgetInputError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("scope:")
            continue
        accepted.setdefault(limit_name(scope), set()).add(scope)
    assert all(len(scopes) == 1 for scopes in accepted.values())


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_malformed_sweep_yaml(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("yaml") / "sweep.yaml"
    path.write_text(text)
    try:
        SweepSpec.from_yaml(path)
    except (BudgetInputError, ValidationError) as exc:
        assert "\n" not in one_line(exc)
