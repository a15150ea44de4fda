"""The gate's job variables (workers/job_variables.py): every one is the deployment's or the
run's, and the rule for a run's own."""

from __future__ import annotations

import pytest

from prefect_gpu_budget.workers import job_variables


def test_every_gate_variable_is_the_deployments_or_the_runs():
    both = set(job_variables.GATE_VARIABLES) | set(job_variables.RUN_VARIABLES)
    assert both == set(job_variables.GateVariables.model_fields)


@pytest.mark.parametrize(
    ("run_variables", "may_set", "refusal"),
    [
        ({}, [], ""),
        ({"scope": "lab/gpu/a", "agent_token": "t"}, [], ""),
        ({"stream_output": False}, ["stream_output"], ""),
        ({"scope": "lab"}, [], "scope 'lab' is not within the deployment's scope 'lab/gpu'"),
        ({"max_runtime": "9h"}, ["stream_output"], "job variable max_runtime is the"),
        ({"run_may_set": ["command"], "command": "x"}, [], "job variable run_may_set is the"),
        ({"command": "x"}, [], "job variable command is the deployment's to set, not a run's"),
        ({"env": {}}, ["stream_output"], "job variable env is the deployment's"),
        ({"anything": 1}, [], "job variable anything is the deployment's"),
        ({}, ["scope"], "run_may_set: scope is the gate's; a run can never set it"),
        ({}, "command", "run_may_set: must be a list of job variable names"),
    ],
)
def test_a_run_may_narrow_its_scope_and_set_what_its_deployment_lists(
    run_variables, may_set, refusal
):
    found = job_variables.overrides_refusal(run_variables, "lab/gpu", may_set)
    assert found.startswith(refusal) and (found == "") == (refusal == ""), found
