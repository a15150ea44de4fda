"""What a job asks for when it names accelerators, not a machine, in SkyPilot's spelling:
`H100:8` (a model and a count per node), `{H100:8, H200:8}` or `H100:8,H200:8` (any of these),
`A100-80GB:8` (a model with its memory). A bare model name means its smallest-memory variant,
as in SkyPilot (`A100` is the 40 GB one); `A100-80GB` names the other."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prefect_gpu_budget.units import BudgetInputError, near, shown

MAX_COUNT = 64
_ONE_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9]*(?:-\d+GB)?)\s*(?::\s*(\d+))?\s*$")


class Shape(Protocol):
    """A machine as the catalog describes it (`pricing.catalog.PriceRow` is one)."""

    cloud: str
    instance_type: str
    provisioning: str
    gpu_model: str
    gpus: int
    vcpu: int
    memory_gib: int


@dataclass(frozen=True)
class Accelerators:
    """Any of `models`, `count` of them on each node."""

    models: tuple[str, ...]
    count: int

    def spelled(self) -> str:
        """`H100:8`, or `{A100-80GB:8, H100:8}` for a set."""
        one = [f"{m}:{self.count}" for m in self.models]
        return one[0] if len(one) == 1 else "{" + ", ".join(one) + "}"


def parse_accelerators(value: object) -> Accelerators:
    """`H100:8`, `H100`, `{H100:8, H200:8}`, `H100:8,H200:8`, or a mapping `{"H100": 8}`. Every
    model of a set must ask for the same count (a node holds one machine shape)."""
    if isinstance(value, Accelerators):
        return value
    if isinstance(value, Mapping):
        parts = [f"{k}:{v}" for k, v in value.items()]
    elif isinstance(value, str):
        parts = value.strip().removeprefix("{").removesuffix("}").split(",")
    else:
        raise BudgetInputError(
            "accelerators", f"expected text such as 'H100:8', got {shown(value)}"
        )
    models: list[str] = []
    counts = set()
    for part in parts:
        found = _ONE_RE.match(part)
        if not found:
            raise BudgetInputError(
                "accelerators", f"expected MODEL:COUNT such as 'H100:8', got {shown(part.strip())}"
            )
        count = int(found.group(2) or 1)
        if not 1 <= count <= MAX_COUNT:
            raise BudgetInputError("accelerators", f"count must be 1 to {MAX_COUNT}, got {count}")
        models.append(found.group(1).upper())
        counts.add(count)
    if len(counts) != 1:
        raise BudgetInputError(
            "accelerators",
            "every model of a set asks for the same count per node, got "
            + ", ".join(p.strip() for p in parts),
        )
    return Accelerators(tuple(dict.fromkeys(models)), counts.pop())


def model_names(gpu_model: str, all_models: Iterable[str]) -> set[str]:
    """The names a catalog model answers to: `H100 80GB` is `H100-80GB`, and `H100` when no
    other H100 has less memory; a model that names no memory (a pool's `H100`) is `H100`."""
    base, _, memory = gpu_model.upper().partition(" ")
    names = {f"{base}-{memory}" if memory else base}
    sizes = [_memory_gb(m) for m in all_models if m.upper().partition(" ")[0] == base]
    smallest = min((size for size in sizes if size), default=0)  # a pool's model has none
    if _memory_gb(gpu_model) in (0, smallest):
        names.add(base)
    return names


def _memory_gb(gpu_model: str) -> int:
    found = re.search(r"(\d+)\s*GB", gpu_model.upper())
    return int(found.group(1)) if found else 0


def matching(wanted: Accelerators, shapes: Iterable[Shape]) -> list[Shape]:
    """The machines that carry one of the wanted models, exactly `count` of them (a machine with
    more GPUs than asked is a bigger machine, billed whole: it is not offered). Bad input gets one
    line: a model no machine has (with the nearest names), a count larger than any machine."""
    shapes = list(shapes)
    models = {s.gpu_model for s in shapes if s.gpus}
    known: dict[str, set[str]] = {}
    for model in models:
        for name in model_names(model, models):
            known.setdefault(name, set()).add(model)
    unknown = [w for w in wanted.models if w not in known]
    if unknown:
        close = near(unknown[0], known)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise BudgetInputError(
            "accelerators", f"no offering has {unknown[0]}{hint}; known: {', '.join(sorted(known))}"
        )
    targets = set().union(*(known[w] for w in wanted.models))
    same_model = [s for s in shapes if s.gpu_model in targets]
    most = max(s.gpus for s in same_model)
    if wanted.count > most:
        raise BudgetInputError(
            "accelerators",
            f"{wanted.spelled()} asks for more than any machine holds "
            f"(at most {most} per node); ask for more nodes instead",
        )
    found = [s for s in same_model if s.gpus == wanted.count]
    if not found:
        sizes = sorted({s.gpus for s in same_model})
        raise BudgetInputError(
            "accelerators",
            f"no machine holds exactly {wanted.count} of "
            f"{' or '.join(wanted.models)}; machines hold {', '.join(map(str, sizes))}",
        )
    return found
