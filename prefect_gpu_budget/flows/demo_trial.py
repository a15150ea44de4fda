"""A tiny real training run for the demo: a one-hidden-layer network on a synthetic task, numpy only.

Writes JSON lines (`{"step": 10, "loss": 0.31}` ... then a summary) to the file named by
GPU_BUDGET_METRICS_FILE, as any trial program in any language can. It ends `--seconds` after its
process started, however long the interpreter and numpy took to start: the length the demo's
forecast expects of it, on a busy machine too.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from prefect_gpu_budget.settings import metrics_file


def started_at() -> float:
    """When this process started, on the wall clock (Linux: its start in clock ticks against the
    system's uptime, to 10 ms); elsewhere, now."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - max(0.0, age)


def main() -> None:
    start = started_at()
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="Pretend GPU time per trial, start-up included."
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8))
    y = (np.sin(x[:, :1] * 2) + x[:, 1:2] ** 2 > 0.5).astype(float)
    w1 = rng.normal(scale=0.5, size=(8, args.width))
    w2 = rng.normal(scale=0.5, size=(args.width, 1))
    out = open(metrics_file() or os.devnull, "a")  # noqa: SIM115
    loss = float("nan")
    for step in range(1, args.steps + 1):
        h = np.tanh(x @ w1)
        p = 1 / (1 + np.exp(-(h @ w2)))
        loss = float(-np.mean(y * np.log(p + 1e-9) + (1 - y) * np.log(1 - p + 1e-9)))
        grad = (p - y) / len(x)
        w1 -= args.lr * x.T @ ((grad @ w2.T) * (1 - h**2))
        w2 -= args.lr * h.T @ grad
        if step % 25 == 0:
            out.write(json.dumps({"step": step, "loss": round(loss, 5)}) + "\n")
            out.flush()
        time.sleep(max(0.0, start + args.seconds * step / args.steps - time.time()))
    accuracy = float(np.mean((p > 0.5) == y))
    out.write(json.dumps({"summary": True, "loss": round(loss, 5), "accuracy": accuracy}) + "\n")
    out.close()
    print(f"lr={args.lr} width={args.width} loss={loss:.4f} accuracy={accuracy:.3f}")


if __name__ == "__main__":
    main()
