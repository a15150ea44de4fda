"""`python -m benchmarks.chaos`: the options, the campaign, its report."""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/chaos`
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json

import benchmarks.chaos
from benchmarks.chaos.campaign import run
from benchmarks.chaos.config import FAULTS, PHASES, STEPS
from benchmarks.chaos.report import report


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos", description=benchmarks.chaos.__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=200, help="runs, one random kill each")
    parser.add_argument("--url", help="SQLAlchemy URL of the ledger (default: SQLite, temp)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--api-url",
        help="a running Prefect server with its lease repossessor (default: start one)",
    )
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    marks = [f"{side}{call}" for call in STEPS for side in "><"]
    parser.add_argument(
        "--park-at",
        default="",
        help=f"after the random runs, one run per step mark, of {','.join(marks)}",
    )
    parser.add_argument(
        "--faults", default="", help=f"after the kills, runs of each of {','.join(FAULTS)}"
    )
    parser.add_argument("--fault-repeat", type=int, default=1, help="runs of each fault")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    phases = tuple(args.phases.split(","))
    if not phases or not set(phases) <= set(PHASES):
        parser.error(f"--phases: a comma-separated subset of {','.join(PHASES)}")
    park_at = tuple(m for m in args.park_at.split(",") if m)
    if not set(park_at) <= set(marks):
        parser.error(f"--park-at: comma-separated marks of {','.join(marks)}")
    faults = tuple(f for f in args.faults.split(",") if f)
    if not set(faults) <= set(FAULTS) or args.fault_repeat < 1:
        parser.error(f"--faults: comma-separated kinds of {','.join(FAULTS)}; --fault-repeat >= 1")
    if args.runs < 0 or args.runs + len(park_at) + len(faults) == 0:
        parser.error("nothing to run: --runs N (N > 0), --park-at or --faults")
    out = run(
        args.runs, args.url, args.seed, args.api_url, phases, park_at, faults, args.fault_repeat
    )
    print(json.dumps(out, indent=2) if args.json else report(out))
    sys.exit(1 if out["lost"] else 0)


if __name__ == "__main__":
    main()
