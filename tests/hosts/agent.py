"""One admitter of the multi-host tests, run inside a host's namespaces: admits, runs and settles
jobs through a real `Gate`, a PostgreSQL ledger and the Prefect replica of its
`PREFECT_API_URL`, the way a worker of the budget-gated work pools does (`run_admitted` with the
local launcher: the job is a real process under its job holder), and tells the test each step
as one JSON line on its stdout.

`python -m tests.hosts.agent '<json>'`, the JSON holding `ledger_url`, `prices`, `scope`, `jobs`
(how many, one after another in each of `threads` threads), `instance_type`, `job_s` (how long
each job's process sleeps) or `command` (the job's command instead), `max_runtime`, `max_wait`,
`heartbeat_s` and `recheck_s` (the gate's clocks: how often an admitted job's row is stamped and
its lease renewed, and a waiting one's) and `wait_for_go` (read one line of stdin before the
first request, so that every agent of a race starts at once, after its imports).

Lines: `ready` (with `holder`, this process's `host:pid:start-ticks`), then per job `admitted`,
`started`, `settled` (its outcome) and `again` (what a second settlement changed: never
anything), or `refused` (the state and reason); `done` at the end; `error` with a traceback if
the process fails.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

_say_lock = threading.Lock()


def say(event: str, **fields: Any) -> None:
    with _say_lock:
        print(json.dumps({"e": event, "t": time.time(), **fields}), flush=True)


def run(config: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.lifecycle import run_admitted
    from prefect_gpu_budget.admission.limits import RateLimits
    from prefect_gpu_budget.identity import holder_id
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.launchers.local import LocalLauncher
    from prefect_gpu_budget.pricing.catalog import Catalog

    ledger = Ledger(config["ledger_url"], create=False)
    with get_client(sync_client=True) as client:
        gate = Gate(
            ledger,
            RateLimits(client),
            catalog=Catalog.load(Path(config["prices"])),
            heartbeat_s=float(config["heartbeat_s"]),
            recheck_s=float(config.get("recheck_s", 3.0)),
        )
        say("ready", holder=holder_id(), api=str(client.api_url))
        if config.get("wait_for_go"):
            sys.stdin.readline()

        def one_thread(index: int) -> None:
            for n in range(int(config["jobs"])):
                job = GpuJob(
                    instance_type=config["instance_type"],
                    max_runtime=config["max_runtime"],
                    kill_grace="1s",
                    max_wait=config["max_wait"],
                    command=config.get("command") or ["sleep", f"{float(config['job_s']):.3f}"],
                    name=f"{config.get('name', 'hosts')}-{index}-{n}",
                )
                try:
                    admission = gate.admit(job, config["scope"])
                except AdmissionRefused as refused:
                    say("refused", state=refused.state_name, reason=str(refused)[:300])
                    continue
                job_id = admission.job_id
                say("admitted", job=job_id, slots=admission.slots, lease=admission.lease_id)
                ended = run_admitted(
                    gate,
                    admission,
                    LocalLauncher(),
                    phase=lambda name, job_id=job_id: say(name, job=job_id),
                )
                say("settled", job=job_id, outcome=ended.result.outcome)
                again = ledger.settlements.settle(
                    job_id, ended_at=time.time() + 100, outcome="completed"
                )
                say("again", job=job_id, changed=again is not None)

        threads = [
            threading.Thread(target=one_thread, args=(i,)) for i in range(int(config["threads"]))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    ledger.db.dispose()
    say("done")


def main(argv: list[str]) -> int:
    try:
        run(json.loads(argv[0]))
    except BaseException:
        say("error", traceback=traceback.format_exc()[-3000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
