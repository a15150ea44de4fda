"""The settings this package reads, in one place, without importing Prefect where it can.

Prefect's own settings (PREFECT_HOME, PREFECT_API_URL) come from the environment, the active
profile in `profiles.toml`, or a `prefect.toml`, `.env` or `pyproject.toml` in the working
directory. Importing `prefect.settings` to read them costs seconds, which the ledger and catalog
commands of the CLI must not pay. So: the environment and the profile are read here directly;
only when the working directory holds a file that Prefect would also read is Prefect asked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
JOB_ID_ENV = "GPU_BUDGET_JOB_ID"
"""Set in an admitted job's environment (`lifecycle.run_admitted`): its ledger job id. A cloud
launcher marks the cloud's job with it (`launchers/bill_mark.py`); the job's own process gets it
too."""
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


def prices_path() -> Path | None:
    """The prices CSV this host reads besides the catalog (PREFECT_GPU_BUDGET_PRICES): none by
    default, so every host on a ledger prices `local:` machines from the ledger alone."""
    explicit = os.environ.get(PRICES_ENV)
    return Path(explicit) if explicit else None


def catalog_dir() -> Path:
    """Where refreshed catalogs are written (PREFECT_GPU_BUDGET_CATALOG_DIR)."""
    explicit = os.environ.get(CATALOG_DIR_ENV)
    return Path(explicit) if explicit else prefect_home() / "gpu-budget" / "catalogs"


# -- the sandbox agents' jobs run in (`sandbox/launcher.py`) ---------------------------------

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
AGENT_UIDS_ENV = "PREFECT_GPU_BUDGET_AGENT_UIDS"
"""A range of uids, `FIRST-LAST` (e.g. `60000-60999`): each agent session's jobs run as a user
of its own from it, created as needed; when set, PREFECT_GPU_BUDGET_AGENT_USER is not used."""
AGENT_LIMIT_ENVS = {
    "nproc": "PREFECT_GPU_BUDGET_AGENT_LIMIT_NPROC",
    "nofile": "PREFECT_GPU_BUDGET_AGENT_LIMIT_NOFILE",
    "fsize": "PREFECT_GPU_BUDGET_AGENT_LIMIT_FSIZE",
    "as": "PREFECT_GPU_BUDGET_AGENT_LIMIT_AS",
    "disk": "PREFECT_GPU_BUDGET_AGENT_LIMIT_DISK",
    "output": "PREFECT_GPU_BUDGET_AGENT_LIMIT_OUTPUT",
}
"""Each agent job's resource limits (RLIMIT_NPROC, _NOFILE, _FSIZE, _AS; and, enforced by the
launcher, the size of its folder, /tmp included, and of its output): a number (a size may end
in K, M, G or T, powers of 1024) or `unlimited`; unset: the sandbox's defaults."""
AGENT_NETWORK_ENV = "PREFECT_GPU_BUDGET_AGENT_NETWORK"
"""The network agents' jobs get: `none` (the default: a network namespace of their own with
only its own loopback, and their own /proc), an HTTP(S) proxy's URL (`http://proxy:3128`:
their one way out, through a relay on their own loopback), or `host` (the admin's opt-out:
the host's network and /proc, the host's own services included)."""


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


def agent_uids() -> str | None:
    """PREFECT_GPU_BUDGET_AGENT_UIDS as given, or None when unset or blank."""
    return os.environ.get(AGENT_UIDS_ENV, "").strip() or None


def agent_limits() -> dict[str, str]:
    """The limits set in PREFECT_GPU_BUDGET_AGENT_LIMIT_* (name -> text as given; blank ones
    left out): the sandbox parses them and keeps its defaults for the rest."""
    found = {name: os.environ.get(env, "").strip() for name, env in AGENT_LIMIT_ENVS.items()}
    return {name: text for name, text in found.items() if text}


def agent_network() -> str:
    """PREFECT_GPU_BUDGET_AGENT_NETWORK as given, `none` when unset or blank (the sandbox
    checks it when a job is)."""
    return os.environ.get(AGENT_NETWORK_ENV, "").strip() or "none"


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


# -- hardening: the gateway's proxies, secrets on the command line, private state ------------

GATEWAY_TRUSTED_PROXIES_ENV = "PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES"
"""Comma-separated IPs or CIDRs of the proxies in front of the agent gateway: only from these
is `X-Forwarded-For` believed (default: none, the socket's peer is the client)."""
GATEWAY_REDIS_URL_ENV = "PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL"
"""A Redis URL (`redis://host:6379/0`, `rediss://...`) where every agent gateway that names it
counts bad tokens, calls and long polls (`agents.throttle.RedisStore`); unset: each gateway
counts its own."""
ALLOW_SHARED_HOME_ENV = "PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME"
"""`1` or `true`: start even when PREFECT_HOME or a SQLite ledger is open to other users (a
loud warning instead of a refusal)."""


def gateway_trusted_proxies(text: str | None = None) -> tuple[Any, ...]:
    """The networks (`ipaddress.ip_network`) of `text`, default
    PREFECT_GPU_BUDGET_GATEWAY_TRUSTED_PROXIES; ValueError naming the entry that is neither an
    IP nor a CIDR."""
    import ipaddress

    if text is None:
        text = os.environ.get(GATEWAY_TRUSTED_PROXIES_ENV, "")
    networks = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(
                f"{GATEWAY_TRUSTED_PROXIES_ENV}: {entry[:64]!r} is neither an IP address nor a "
                "CIDR (e.g. 10.0.0.5,10.1.0.0/16)"
            ) from None
    return tuple(networks)


def gateway_redis_url() -> str | None:
    """PREFECT_GPU_BUDGET_GATEWAY_REDIS_URL, or None when unset or blank: gateways behind one
    load balancer must share their limits (bad tokens per address, calls per grant, long polls
    per grant and in all) there, or each would allow a client the whole of them again.
    ValueError, naming the setting but not the URL (it may hold a password), for a URL that is
    not Redis's."""
    url = os.environ.get(GATEWAY_REDIS_URL_ENV, "").strip() or None
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"{GATEWAY_REDIS_URL_ENV}: a Redis URL starts with redis://, rediss:// or unix://"
        )
    return url


def allow_shared_home() -> bool:
    """Whether PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME opts in (`1`, `true`, `yes`, `on`)."""
    value = os.environ.get(ALLOW_SHARED_HOME_ENV, "").strip().lower()
    return value in ("1", "true", "yes", "on")


def url_has_password(url: str) -> bool:
    """Whether a database URL carries a password: in its user info (read as the ledger reads
    it, up to the last `@`) or as a `password=` query parameter."""
    from urllib.parse import parse_qsl

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.startswith("sqlite"):
        return False
    location, _, query = rest.partition("?")
    if "@" in location and location.rpartition("@")[0].partition(":")[2]:
        return True
    return any(
        key.lower() in ("password", "passwd", "pwd") and value
        for key, value in parse_qsl(query, keep_blank_values=True)
    )


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite ledger URL (None for another database or an in-memory one)."""
    if not url.startswith("sqlite"):
        return None
    path = url.split("///", 1)[-1].partition("?")[0]
    if not path or path == ":memory:" or path.startswith("file:") or "://" in path:
        return None
    return Path(path).expanduser()


class SharedStateError(ValueError):
    """PREFECT_HOME or the ledger is open to other users: one line, with the fix."""


def _open_to_others(path: Path, bits: int) -> int:
    """The `bits` of `path`'s mode that other users can use: none when a folder above it lets
    them not pass (world: no `o+x`; group: neither `g+x` nor `o+x`)."""
    mode = path.stat().st_mode & bits
    for folder in path.resolve().parents:
        if not mode:
            break
        above = folder.stat().st_mode
        if not above & 0o001:
            mode &= ~0o007
        if not above & 0o011:
            mode &= ~0o070
    return mode


@dataclass(frozen=True)
class _Open:
    """A path of this process's state that other users can reach."""

    name: str
    """How a message names it: `PREFECT_HOME /x`, `the ledger file /x/ledger.db`."""
    path: Path
    detail: str
    """Its mode, as a message shows it."""
    private: int
    """The mode that closes it: 0700 for PREFECT_HOME, 0600 for a ledger file."""


def _open_state(url: str | None) -> list[_Open]:
    """PREFECT_HOME if other users can reach it (`mode & 0o007`), and the SQLite ledger's files
    (`url`, default the configured ledger) if group or others can (`mode & 0o077`), counting the
    folders above them. A path that does not exist (yet) is not among them."""
    import stat

    found = []
    home = prefect_home()
    try:
        if home.is_dir() and (mode := _open_to_others(home, 0o007)):
            full = stat.S_IMODE(home.stat().st_mode)
            found.append(
                _Open(f"PREFECT_HOME {home}", home, f"mode {full:04o}, others: {mode:03o}", 0o700)
            )
    except OSError:
        pass
    ledger = sqlite_file(ledger_url(url))
    for path in () if ledger is None else (ledger, Path(f"{ledger}-wal"), Path(f"{ledger}-shm")):
        try:
            if path.is_file() and _open_to_others(path, 0o077):
                full = stat.S_IMODE(path.stat().st_mode)
                found.append(_Open(f"the ledger file {path}", path, f"mode {full:04o}", 0o600))
        except OSError:
            continue
    return found


def _close_own(found: _Open) -> str | None:
    """Close `found` to group and others if this user owns it (its owner's bits kept, at most
    `found.private`): the line that says so, else None (another user's, or gone)."""
    import stat

    try:
        fd = os.open(found.path, os.O_RDONLY)  # what is checked is what is changed
    except OSError:
        return None
    try:
        held = os.fstat(fd)
        if held.st_uid != os.geteuid():
            return None
        mode = stat.S_IMODE(held.st_mode) & found.private
        os.fchmod(fd, mode)
    except OSError:
        return None
    finally:
        os.close(fd)
    return f"{found.name} was open to other users ({found.detail}): made it {mode:04o}"


def check_private_state(
    url: str | None = None,
    allow_shared: bool = False,
    closed: Callable[[str], None] | None = None,
) -> str | None:
    """The startup check of `serve`, the workers and `agents serve`: PREFECT_HOME (its profiles
    hold the Prefect API's auth string) must be closed to other users, and a SQLite ledger
    file (every session's rows) to group and others (`_open_state`). None when they are; else
    the one-line problem and its fix, raised as `SharedStateError`, or, with `allow_shared` or
    PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME, returned for the caller to warn with. Given `closed`,
    and not allowed to share, it first closes what this user owns (PREFECT_HOME to 0700, a
    ledger file to 0600) and says each in one line through `closed`: only another user's path
    is refused. The ledger creates its file 0600. Never imports Prefect unless `prefect_home`
    must."""
    if os.name == "nt":
        return None
    allowed = allow_shared or allow_shared_home()
    problems = []
    for found in _open_state(url):
        said = None if allowed or closed is None else _close_own(found)
        if said is not None:
            closed(said)
            continue
        try:
            owner = found.path.stat().st_uid
        except OSError:
            continue
        fix = f"chmod {found.private:o} {found.path}"
        if owner != os.geteuid():
            fix = f"it belongs to uid {owner}, not to this user: its owner can {fix}"
        problems.append(f"{found.name} is open to other users ({found.detail}): {fix}")
    if not problems:
        return None
    message = "; ".join(problems)
    if allowed:
        return message
    raise SharedStateError(
        f"{message} (or, knowingly, --allow-shared-home or {ALLOW_SHARED_HOME_ENV}=1)"
    )
