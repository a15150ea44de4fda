"""How an admission ends other than with a running job."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules.policy import Decision


class AdmissionRefused(Exception):
    """The gate said no for good: `state_name` is `OverBudget`, `AdmissionTimeout`,
    `UnknownScope` (its org or team was never created), or `Cancelled` (its owner cancelled it
    while it waited)."""

    def __init__(self, state_name: str, reason: str, job_id: str) -> None:
        self.state_name = state_name
        self.reason = reason
        self.job_id = job_id
        super().__init__(f"{state_name}: {reason}")


def refuse(job_id: str, decision: Decision) -> None:
    """Raise the refusal a rejection or a time-out is (`OverBudget`, `Cancelled`,
    `AdmissionTimeout`); nothing for any other decision."""
    if decision.verdict == "reject":
        name = "Cancelled" if decision.limit == "cancelled" else "OverBudget"
        raise AdmissionRefused(name, decision.reason, job_id)
    if decision.verdict == "timeout":
        raise AdmissionRefused("AdmissionTimeout", decision.reason, job_id)


class AdmissionGone(RuntimeError):
    """The job's ledger row was settled (by reconcile, say) while it was being
    admitted: the slots it had just taken were handed back."""
