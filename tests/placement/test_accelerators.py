"""Accelerators in SkyPilot's spelling, matched against the shipped catalog's machines."""

from __future__ import annotations

import pytest

from prefect_gpu_budget.placement.accelerators import (
    Accelerators,
    matching,
    model_names,
    parse_accelerators,
)
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import BudgetInputError


@pytest.fixture(scope="module")
def shapes():
    return Catalog.load().rows()


@pytest.mark.parametrize(
    ("text", "models", "count"),
    [
        ("H100:8", ("H100",), 8),
        ("h100", ("H100",), 1),
        ("{H100:8, H200:8}", ("H100", "H200"), 8),
        ("A100-80GB:8,H100:8", ("A100-80GB", "H100"), 8),
        ({"L4": 4}, ("L4",), 4),
    ],
)
def test_the_spellings(text, models, count):
    assert parse_accelerators(text) == Accelerators(models, count)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("H100:0", "count must be 1 to 64"),
        ("H100:8,H200:4", "same count"),
        ("8xH100", "expected MODEL:COUNT"),
        (8, "expected text"),
    ],
)
def test_bad_spellings_get_one_line(text, says):
    with pytest.raises(BudgetInputError, match=says) as caught:
        parse_accelerators(text)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("accelerators: ")


def test_a_bare_model_is_its_smallest_memory_as_in_skypilot():
    models = ["A100 40GB", "A100 80GB", "H100 80GB"]
    assert model_names("A100 40GB", models) == {"A100", "A100-40GB"}
    assert model_names("A100 80GB", models) == {"A100-80GB"}
    assert model_names("H100 80GB", models) == {"H100", "H100-80GB"}


def test_machines_with_exactly_the_count_match(shapes):
    found = {
        (s.cloud, s.instance_type, s.provisioning)
        for s in matching(parse_accelerators("H100:8"), shapes)
    }
    assert ("gcp", "a3-highgpu-8g", "flex-start") in found
    assert ("aws", "p5.48xlarge", "spot") in found
    assert ("sagemaker", "ml.p5.48xlarge", "on-demand") in found
    assert all(s.gpus == 8 for s in matching(parse_accelerators("H100:8"), shapes))
    a100 = {s.instance_type for s in matching(parse_accelerators("A100:1"), shapes)}
    assert a100 == {"a2-highgpu-1g"}  # the 40 GB one, not a2-ultragpu-1g


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("H10:8", "no offering has H10 .did you mean H100"),
        ("H100:16", "more than any machine holds .at most 8 per node."),
        ("H100:2", "no machine holds exactly 2 of H100; machines hold 8"),
    ],
)
def test_what_no_machine_has_gets_one_line(shapes, text, says):
    with pytest.raises(BudgetInputError, match=says):
        matching(parse_accelerators(text), shapes)
