"""The sandbox agents' local jobs run in (`LocalLauncher(sandbox=Sandbox.from_env())`).

- `launcher.py`: `Sandbox`, which checks a job and prepares it: its user, folder, environment;
- `users.py`: who the job runs as, the agent sessions' own users, their locks and leftovers;
- `env.py`: what of the worker's environment the job gets, and what its output must not show;
- `interpreter.py`: the Python the job's `python` starts, and the trial runner it reaches;
- `limits.py`: the job's limits, the kernel's and the launcher's (its disk, its output);
- `isolation.py`: the job's own network, files and /proc, and whether this host can give them;
- `job.py`: one job's sandbox while it runs (`SandboxedJob`) and once it has ended;
- the job holder, which every local job runs under, started as a file and standard library
  only: `holder.py` (the process tree's life, its command line), `spawn.py` (how the command
  starts, its namespaces), `walls.py`, `sockets.py` and `relay.py` (an isolated job's walls,
  the host's sockets they cover, and its one way out), each loaded by its path.
"""

from prefect_gpu_budget.sandbox.job import SandboxedJob
from prefect_gpu_budget.sandbox.launcher import Sandbox

__all__ = ["Sandbox", "SandboxedJob"]
