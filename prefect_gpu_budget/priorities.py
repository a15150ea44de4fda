"""Priority classes: named priorities, as Kueue's WorkloadPriorityClass and HyperPod's task
priority classes are.

Three are built in (high, normal, low); a process may add more through an environment variable,
and an admin defines an org's own in the ledger (`prefect-gpu-budget priority set`, or the
`GpuPriorityClass` block). A job names a class or gives an integer in -1000..1000. Built-in and
environment classes resolve when the job is validated; an org's own class resolves in the
transaction that records the job, against the classes its org has then, so an unknown name is
refused there in one line with nothing written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache

from prefect_gpu_budget import settings
from prefect_gpu_budget.settings import PRIORITY_CLASSES_ENV
from prefect_gpu_budget.units import BudgetInputError, near, shown

PRIORITY_CLASSES = {"high": 100, "normal": 0, "low": -100}
NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
LOWEST, HIGHEST = -1000, 1000


def priority_classes() -> dict[str, int]:
    """The named priority classes: high, normal, low, plus those the environment defines."""
    return {**PRIORITY_CLASSES, **_parse_classes(settings.priority_classes_text())}


@lru_cache(maxsize=8)
def _parse_classes(text: str) -> dict[str, int]:
    found = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            number = int(value)
        except ValueError:
            number = None
        if not NAME_RE.fullmatch(name) or number is None:
            raise BudgetInputError(
                PRIORITY_CLASSES_ENV, f"expected name=integer, got {shown(item)}"
            )
        if not LOWEST <= number <= HIGHEST:
            raise BudgetInputError(PRIORITY_CLASSES_ENV, f"{name}: must be in -1000..1000")
        found[name] = number
    return found


def check_class(name: object, value: object) -> tuple[str, int]:
    """An org's own class as an admin defines it: a new name and a value in range."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise BudgetInputError(
            "name", f"a class name is lowercase letters, digits, - and _, got {shown(name)}"
        )
    if name in priority_classes():
        raise BudgetInputError("name", f"{name} is a class every org has (high, normal, low)")
    if isinstance(value, bool) or not isinstance(value, int) or not LOWEST <= value <= HIGHEST:
        raise BudgetInputError("value", f"must be an integer in -1000..1000, got {shown(value)}")
    return name, value


def resolve(name: str, defined: Mapping[str, int], org: str) -> int:
    """The value of the class `name` among the built-in, environment and org's own classes."""
    classes = {**defined, **priority_classes()}
    if name in classes:
        return classes[name]
    close = near(name, classes)
    known = ", ".join(sorted(classes, key=lambda n: -classes[n]))
    hint = f"did you mean {close[0]}? " if close else ""
    raise BudgetInputError(
        "priority", f"no priority class {shown(name)} in {org}; {hint}known: {known}"
    )
