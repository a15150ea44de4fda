"""`python -m benchmarks.soak`: the options, then the run (or, with the hidden `--agent`, one
agent process) and its report."""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/soak`
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json

import benchmarks.soak
from benchmarks.soak.agent import agent_main
from benchmarks.soak.config import KINDS, PG_URL, Config
from benchmarks.soak.report import report
from benchmarks.soak.run import run
from prefect_gpu_budget.testing.postgres import named_or_own


def parse_mix(text: str) -> dict[str, int]:
    """`interrupt=0,run=70` -> the default mix with those weights replaced."""
    mix = dict(KINDS)
    for part in filter(None, text.split(",")):
        kind, _, weight = part.partition("=")
        if kind not in KINDS or not weight.isdigit():
            raise argparse.ArgumentTypeError(f"expected KIND=WEIGHT with KIND in {list(KINDS)}")
        mix[kind] = int(weight)
    if not any(mix.values()):
        raise argparse.ArgumentTypeError("at least one weight must be positive")
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=benchmarks.soak.__doc__.splitlines()[0]
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="measured run length")
    parser.add_argument("--agents", type=int, default=8, help="agent processes")
    parser.add_argument(
        "--url",
        default=PG_URL,
        help="PostgreSQL ledger (its tables are dropped; default: a database of the run's own)",
    )
    parser.add_argument(
        "--warmup", type=float, help="seconds left out at the start (default 10%%, 5-60 s)"
    )
    parser.add_argument(
        "--edge", type=float, default=0.1, help="start/end window, fraction of the run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", metavar="DIR", help="keep the agents' samples and logs here")
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=dict(KINDS),
        help="job mix as weights, e.g. interrupt=0 (default: "
        + ",".join(f"{k}={v}" for k, v in KINDS.items())
        + ")",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent_main(args.agent)
        return
    if args.minutes <= 0 or args.agents < 1 or not 0 < args.edge <= 0.5:
        parser.error("--minutes and --agents must be positive, --edge in (0, 0.5]")
    run_s = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(60.0, max(5.0, 0.1 * run_s))
    if warmup >= run_s / 2:
        parser.error("--warmup must be under half the run")
    with named_or_own(args.url, "gate_soak") as url:
        cfg = Config(
            minutes=args.minutes,
            agents=args.agents,
            url=url,
            warmup_s=warmup,
            edge=args.edge,
            sample_s=min(5.0, max(1.0, run_s / 150)),
            seed=args.seed,
            mix=args.mix,
            keep=args.keep,
        )
        out = run(cfg)
    print(json.dumps(out, indent=2, default=str) if args.json else report(out))
    sys.exit(1 if out["missed"] else 0)


if __name__ == "__main__":
    main()
