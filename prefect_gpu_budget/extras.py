"""Optional features and the pip extras that bring their packages.

The core install runs the demo, the gate, the ledger and the local and deployment launchers.
The Vertex AI launcher and the GCP price refresh need google-cloud-aiplatform and
google-cloud-billing, the `vertex` extra; the modules that use them import them on first use
and raise `MissingExtra` when they are absent, so that importing the package, registering its
blocks and loading other blocks never need them.
"""

from __future__ import annotations

DIST = "prefect-gpu-budget"


class MissingExtra(ImportError):
    """A feature's packages are not installed; the message is one line naming the extra."""

    def __init__(self, what: str, extra: str, *, name: str | None = None) -> None:
        self.what = what
        self.extra = extra
        super().__init__(
            f"{what} needs the '{extra}' extra: pip install '{DIST}[{extra}]'", name=name
        )

    def __reduce__(self):  # the arguments, not the message: Prefect may pickle a task's error
        return (type(self), (self.what, self.extra), {"name": self.name})
