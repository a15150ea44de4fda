"""Public names that load on first use (PEP 562), for a package's `__init__`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, public: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: each name in `public` is imported from its
    module on first use and kept in `namespace` (the package's globals) from then on."""

    def __getattr__(name: str) -> Any:
        if name in public:
            value = getattr(importlib.import_module(public[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*namespace, *public])

    return __getattr__, __dir__
