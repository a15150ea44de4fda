"""The agent processes seen from the parent: spawned (`python -m benchmarks.soak --agent`),
readied, started together, watched for silence, awaited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.soak.config import DUMP_SIGNAL, SILENT_S, AgentConfig, Config, log
from prefect_gpu_budget.testing.servers import read_line

ROOT = Path(__file__).resolve().parents[2]
"""The repository root, where `benchmarks.soak` is importable from."""


class Agents:
    """The agent processes: spawned, readied, started together, awaited."""

    def __init__(self, cfg: Config, api_url: str, prices: Path, tmp: Path) -> None:
        env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(tmp / "home")}
        self.outs = [tmp / f"agent-{i}.jsonl" for i in range(cfg.agents)]
        self.logs = [tmp / f"agent-{i}.log" for i in range(cfg.agents)]
        self.procs = []
        self.dumped: set[int] = set()
        for i, scope in enumerate(cfg.scopes()):
            acfg = AgentConfig(
                i,
                scope,
                cfg.url,
                str(prices),
                str(self.outs[i]),
                cfg.sample_s,
                cfg.seed + i,
                cfg.mix,
            )
            with self.logs[i].open("w") as err:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "benchmarks.soak",
                            "--agent",
                            json.dumps(asdict(acfg)),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        env=env,
                        cwd=ROOT,
                    )
                )

    def tail(self, i: int) -> str:
        lines = self.logs[i].read_text().strip().splitlines()
        return " | ".join(lines[-3:]) or f"exit code {self.procs[i].poll()}"

    def ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, proc in enumerate(self.procs):
            if read_line(proc, deadline).strip() != "ready":
                raise RuntimeError(f"agent {i} not ready: {self.tail(i)}")

    def start(self, start: float, end: float) -> None:
        for proc in self.procs:
            proc.stdin.write(f"{start} {end}\n")
            proc.stdin.flush()

    def dead(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]

    def dump_silent(self, now: float) -> None:
        """Write the stacks of every agent whose samples stopped `SILENT_S` ago into its log,
        once, so that a hang can be read after the run."""
        for i, proc in enumerate(self.procs):
            try:
                silent = now - self.outs[i].stat().st_mtime
            except OSError:
                continue
            if silent > SILENT_S and i not in self.dumped and proc.poll() is None:
                self.dumped.add(i)
                log(f"agent {i} silent for {silent:.0f} s; its stacks go to {self.logs[i].name}")
                proc.send_signal(DUMP_SIGNAL)

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(DUMP_SIGNAL)
                time.sleep(1)
                proc.kill()
                proc.wait()
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
