"""The settings this package reads, in one place, without importing Prefect where it can.

Prefect's own settings (PREFECT_HOME, PREFECT_API_URL) come from the environment, the active
profile in `profiles.toml`, or a `prefect.toml`, `.env` or `pyproject.toml` in the working
directory. Importing `prefect.settings` to read them costs seconds, which the ledger and catalog
commands of the CLI must not pay. So: the environment and the profile are read here directly;
only when the working directory holds a file that Prefect would also read is Prefect asked.
"""

from __future__ import annotations

import os
from pathlib import Path

LEDGER_URL_ENV = "PREFECT_GPU_BUDGET_LEDGER_URL"
PRICES_ENV = "PREFECT_GPU_BUDGET_PRICES"
CATALOG_DIR_ENV = "PREFECT_GPU_BUDGET_CATALOG_DIR"
NO_SERVER = (
    "no Prefect server is configured and a temporary one did not start in time (a busy "
    "machine?): run `prefect server start` in another terminal, then `export "
    "PREFECT_API_URL=http://127.0.0.1:4200/api` (or give the temporary one longer with "
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120)"
)
"""What the CLI says, in one line, when it needed a temporary Prefect server and got none."""
METRICS_ENV = "GPU_BUDGET_METRICS_FILE"
"""Set in a trial's environment: the file it appends its JSON lines of metrics to."""
PRIORITY_CLASSES_ENV = "PREFECT_GPU_BUDGET_PRIORITY_CLASSES"
"""More named priority classes, e.g. `urgent=500,scavenger=-500` (values in -1000..1000)."""


def metrics_file() -> str | None:
    """The file a trial appends its metrics to (GPU_BUDGET_METRICS_FILE), if the launcher set one."""
    return os.environ.get(METRICS_ENV) or None


def piped_columns() -> int:
    """How wide the CLI prints tables when its output is piped: COLUMNS, else 200."""
    return int(os.environ.get("COLUMNS") or 200)


def priority_classes_text() -> str:
    """PREFECT_GPU_BUDGET_PRIORITY_CLASSES as given (parsed in priorities.py)."""
    return os.environ.get(PRIORITY_CLASSES_ENV, "")


def _prefect_reads_cwd() -> bool:
    """Whether the working directory has a settings file of Prefect's own."""
    cwd = Path.cwd()
    if (cwd / "prefect.toml").is_file() or (cwd / ".env").is_file():
        return True
    pyproject = cwd / "pyproject.toml"
    try:
        return pyproject.is_file() and "[tool.prefect" in pyproject.read_text(errors="replace")
    except OSError:
        return False


def prefect_home() -> Path:
    """PREFECT_HOME: the environment's, else Prefect's default `~/.prefect`."""
    explicit = os.environ.get("PREFECT_HOME")
    if explicit:
        return Path(explicit).expanduser()
    if _prefect_reads_cwd():
        from prefect.settings import PREFECT_HOME

        return Path(PREFECT_HOME.value())
    return Path("~/.prefect").expanduser()


def _profile_setting(name: str) -> str | None:
    """A setting of the active profile in `profiles.toml`, or None."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: let Prefect read its own file
        return _from_prefect(name)
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or prefect_home() / "profiles.toml")
    try:
        data = tomllib.loads(path.expanduser().read_text())
    except (OSError, ValueError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or data.get("active") or "ephemeral"
    value = data.get("profiles", {}).get(active, {}).get(name)
    return None if value in (None, "") else str(value)


def _from_prefect(name: str) -> str | None:
    import prefect.settings

    value = getattr(prefect.settings, name).value()
    if hasattr(value, "get_secret_value"):  # the auth string is a pydantic secret
        value = value.get_secret_value()
    return None if value in (None, "") else str(value)


def _prefect_setting(name: str) -> str | None:
    """A Prefect setting from the environment, else the working directory's settings files
    (asking Prefect), else the active profile; None when unset or blank."""
    explicit = os.environ.get(name)
    if explicit is not None:
        return explicit or None
    if _prefect_reads_cwd():
        return _from_prefect(name)
    return _profile_setting(name)


def prefect_api_url() -> str | None:
    """PREFECT_API_URL, or None when no Prefect server is configured (Prefect would start a
    temporary one)."""
    return _prefect_setting("PREFECT_API_URL")


def prefect_api_auth() -> str | None:
    """PREFECT_API_AUTH_STRING, for a server closed with basic auth."""
    return _prefect_setting("PREFECT_API_AUTH_STRING")


def default_ledger_url() -> str:
    """The SQLite file under PREFECT_HOME that holds the ledger when no URL is given."""
    return f"sqlite:///{prefect_home() / 'gpu-budget' / 'ledger.db'}"


def ledger_url(explicit: str | None = None) -> str:
    """The ledger's URL: the one given, else PREFECT_GPU_BUDGET_LEDGER_URL, else the default."""
    return explicit or os.environ.get(LEDGER_URL_ENV) or default_ledger_url()


def prices_path() -> Path:
    """The local prices CSV (PREFECT_GPU_BUDGET_PRICES, default under PREFECT_HOME)."""
    explicit = os.environ.get(PRICES_ENV)
    return Path(explicit) if explicit else prefect_home() / "gpu-budget" / "prices.csv"


def catalog_dir() -> Path:
    """Where refreshed catalogs are written (PREFECT_GPU_BUDGET_CATALOG_DIR)."""
    explicit = os.environ.get(CATALOG_DIR_ENV)
    return Path(explicit) if explicit else prefect_home() / "gpu-budget" / "catalogs"


# -- the sandbox agents' jobs run in (`launchers/sandbox.py`) ---------------------------------

LOCAL_MACHINE_ENV = "PREFECT_GPU_BUDGET_LOCAL_MACHINE"
"""The `local:NAME` this machine is priced as: the only type its local launcher runs."""
AGENT_USER_ENV = "PREFECT_GPU_BUDGET_AGENT_USER"
"""The unprivileged user agents' local jobs run as."""
AGENT_ALLOW_ROOT_ENV = "PREFECT_GPU_BUDGET_AGENT_ALLOW_ROOT"
"""`1` or `true`: an admin's opt-in to running agents' jobs as root."""
AGENT_ENV_ENV = "PREFECT_GPU_BUDGET_AGENT_ENV"
"""More names (or `fnmatch` patterns) of the worker's environment that agents' jobs get."""
AGENT_ROOT_ENV = "PREFECT_GPU_BUDGET_AGENT_ROOT"
"""The folder under which each agent job gets a fresh working directory."""
AGENT_RESULTS_ENV = "PREFECT_GPU_BUDGET_AGENT_RESULTS"
"""The folder agents' sweeps keep their results under."""
AGENT_PYTHON_ENV = "PREFECT_GPU_BUDGET_AGENT_PYTHON"
"""The interpreter `python` and `python3` are in agents' jobs (a path, or a name on PATH)."""


def local_machine() -> str | None:
    """The `local:NAME` jobs of this machine's local launcher are priced as (None: any
    `local:` type the admin priced, but never a cloud's)."""
    value = os.environ.get(LOCAL_MACHINE_ENV, "").strip()
    if value and not value.startswith("local:"):
        value = f"local:{value}"
    return value or None


def agent_user() -> str | None:
    """PREFECT_GPU_BUDGET_AGENT_USER, or None when unset or blank."""
    return os.environ.get(AGENT_USER_ENV, "").strip() or None


def agent_allow_root() -> bool:
    """Whether PREFECT_GPU_BUDGET_AGENT_ALLOW_ROOT opts in (`1`, `true`, `yes`, `on`)."""
    return os.environ.get(AGENT_ALLOW_ROOT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def agent_env_extra() -> tuple[str, ...]:
    """The comma-separated names and patterns of PREFECT_GPU_BUDGET_AGENT_ENV."""
    text = os.environ.get(AGENT_ENV_ENV, "")
    return tuple(name for name in (part.strip() for part in text.split(",")) if name)


def agent_python() -> str | None:
    """PREFECT_GPU_BUDGET_AGENT_PYTHON, or None when unset or blank (the sandbox then picks
    this worker's own interpreter, else the system's python3)."""
    return os.environ.get(AGENT_PYTHON_ENV, "").strip() or None


def agent_jobs_root() -> Path:
    """PREFECT_GPU_BUDGET_AGENT_ROOT, default `gpu-budget-agent-jobs` in the system temp dir."""
    import tempfile

    explicit = os.environ.get(AGENT_ROOT_ENV, "").strip()
    return Path(explicit) if explicit else Path(tempfile.gettempdir()) / "gpu-budget-agent-jobs"


def agent_results_root() -> Path:
    """The one folder agents' sweeps write results under, one subfolder per session
    (PREFECT_GPU_BUDGET_AGENT_RESULTS, default `gpu-budget-results/agents` in the working dir)."""
    explicit = os.environ.get(AGENT_RESULTS_ENV)
    return Path(explicit or "gpu-budget-results/agents").resolve()
