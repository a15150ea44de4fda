"""What of the worker's environment an agent's local job gets, and what its output must not show.

- `allowed_env`: the names of the worker's environment an allow-list lets through: exact
  names (`DEFAULT_ENV_ALLOW`, plus `PREFECT_GPU_BUDGET_AGENT_ENV`) and `fnmatch` patterns,
  which never let through a name of `NEVER_BY_PATTERN` nor a value holding a URL's
  credentials;
- `Redactor`: the job's output with every value of the worker's environment the job was not
  given (`known_secrets`), and the password of any URL there, shown as `***`.

`Sandbox` (`launcher.py`) builds the job's whole environment from these.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote

from prefect_gpu_budget.units import redact_urls, url_credentials

DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
    "OMP_NUM_THREADS",
)
"""The names of the worker's environment every agent job gets (when the worker has them)."""
NEVER_BY_PATTERN: tuple[str, ...] = (
    "PREFECT_*",
    "AWS_*",
    "GOOGLE_*",
    "GCLOUD_*",
    "CLOUDSDK_*",
    "AZURE_*",
    "*SECRET*",
    "*TOKEN*",
    "*PASS*",
    "*_PW",
    "*_PWD",
    "*CREDENTIAL*",
    "*CREDS*",
    "*KEY*",
    "*_PAT",
    "*_PAT_*",
    "*AUTH*",
    "*PRIVATE*",
    "*COOKIE*",
    "*SIGNING*",
    "*NETRC*",
    "*DATABASE_URL*",
    "*DB_URL*",
    "*DB_URI*",
    "*DSN*",
    "*CONN*STR*",
)
"""Names an allow-list pattern (`LC_*`, even `*`) never lets through, whatever their case: only
an exact name does. Nor does a pattern let through a value holding a URL's credentials."""
MIN_SECRET_LEN = 8
"""Shorter withheld values (`1`, `true`, `/root`) are not redacted: they would blank out text."""
MIN_PASSWORD_LEN = 4
"""The shortest URL password that is redacted on its own."""


def allowed_env(env_allow: Iterable[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The names of `environ` (the worker's) that the allow-list `env_allow` (names, and
    `fnmatch` patterns like `LC_*`) lets through."""
    env_allow = tuple(env_allow)
    exact = {n for n in env_allow if not _is_pattern(n)}
    patterns = [n for n in env_allow if _is_pattern(n)]
    return {
        name: value
        for name, value in environ.items()
        if name in exact
        or (any(fnmatch.fnmatchcase(name, p) for p in patterns) and _patterns_may(name, value))
    }


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _patterns_may(name: str, value: str) -> bool:
    """Whether an allow-list pattern may pass `name`: none of NEVER_BY_PATTERN matches it (in
    any case), and its value holds no URL credentials."""
    upper = name.upper()
    if any(fnmatch.fnmatchcase(upper, p) for p in NEVER_BY_PATTERN):
        return False
    return not url_credentials(value)


class Redactor:
    """Callable on a log line: each known secret in it becomes `***` (longest first), and so do
    the credentials of any URL (`redact_urls`)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = tuple(sorted({s for s in secrets if s}, key=lambda s: (-len(s), s)))
        self._pattern = re.compile("|".join(map(re.escape, self.secrets))) if self.secrets else None

    def __call__(self, line: str) -> str:
        if self._pattern is not None:
            line = self._pattern.sub("***", line)
        return redact_urls(line)

    @classmethod
    def withheld(
        cls, given: Mapping[str, str], environ: Mapping[str, str] | None = None
    ) -> Redactor:
        """A redactor of what `environ` (the worker's) holds and the job was not `given`."""
        return cls(known_secrets(given, os.environ if environ is None else environ))


def known_secrets(given: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """What the job must not print: each value of `environ` it was not given, of at least
    `MIN_SECRET_LEN` characters, and the password (as written, and decoded) of any URL in
    `environ`. What the job was given, under any name and as part of any value (`PYENV_ROOT`
    inside `PATH`), is its own to print."""
    received = "\0".join(given.values())
    found = []
    for name, value in environ.items():
        if given.get(name) == value:
            continue
        if len(value) >= MIN_SECRET_LEN and value not in received:
            found.append(value)
        for credentials in url_credentials(value):
            password = credentials.partition(":")[2]
            for text in (password, unquote(password)):
                if len(text) >= MIN_PASSWORD_LEN and text not in received:
                    found.append(text)
    return found
