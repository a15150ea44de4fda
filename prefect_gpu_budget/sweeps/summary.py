"""What a sweep's trials table says in words: its best trial, its summary (markdown), and the
one line it ends on. Pure pandas: the sweep flow publishes them (`flow`).
"""

from __future__ import annotations

import pandas as pd

from prefect_gpu_budget.sweeps.spec import SweepSpec
from prefect_gpu_budget.units import fmt_duration, fmt_usd


def best_trial(spec: SweepSpec, df: pd.DataFrame) -> pd.Series | None:
    """The completed trial with the best value of the spec's metric, if any reported it."""
    done = df[df["state"] == "Completed"] if "state" in df else df.iloc[0:0]
    if spec.metric not in done or done[spec.metric].dropna().empty:
        return None
    values = pd.to_numeric(done[spec.metric], errors="coerce")
    if values.dropna().empty:
        return None
    return done.loc[values.idxmin() if spec.goal == "min" else values.idxmax()]


def last_word(spec: SweepSpec, df: pd.DataFrame, planned: int, cancelled: bool) -> str:
    """One line on how the sweep went: what ran, what is best, why trials did not run."""
    done = int((df["state"] == "Completed").sum()) if "state" in df else 0
    words = [f"{done} of {planned} trials completed"]
    best = best_trial(spec, df)
    if best is not None:
        words.append(f"best {spec.metric} {best[spec.metric]:.4g} (trial {int(best['trial'])})")
    elif planned:
        words.append(no_metric(spec))
    if cancelled:
        words.append(f"cancelled: {planned - len(df)} trials not started")
    failed = df[df["state"] != "Completed"] if "state" in df else df.iloc[0:0]
    if len(failed) and done == 0:
        words.append(f"trial {int(failed.iloc[0]['trial'])}: {failed.iloc[0]['reason'][:200]}")
    return "; ".join(words)


def no_metric(spec: SweepSpec) -> str:
    return f"no trial reported {spec.metric!r}"


def short(value: object) -> str:
    """A parameter value as a legend shows it: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(spec: SweepSpec, df: pd.DataFrame, budget: dict | None) -> str:
    done = df[df["state"] == "Completed"]
    lines = [f"# Sweep `{spec.name}` in `{spec.scope}`", ""]
    lines.append(
        f"- trials: {len(df)}; finished {len(done)}; "
        + ", ".join(
            f"{state} {count}"
            for state, count in df["state"].value_counts().items()
            if state != "Completed"
        )
    )
    best = best_trial(spec, df)
    if best is not None:
        params = ", ".join(f"{p}={short(best[p])}" for p in spec.params())
        lines.append(
            f"- best trial {int(best['trial'])}: {spec.metric} {best[spec.metric]:.4g} ({params})"
        )
    else:
        lines.append(f"- warning: {no_metric(spec)}")
    if spec.random:
        lines.append(f"- random draws from seed {spec.seed} (give `seed` to repeat them)")
    spent = int(round(df["cost_usd"].sum() * 1_000_000))
    if budget is not None:
        lines.append(
            f"- spent {fmt_usd(spent)}; {budget['scope']} has {fmt_usd(budget['settled_micro'])} settled of its "
            f"{fmt_usd(budget['period_budget_micro'])} {budget['period']} budget"
        )
    else:
        lines.append(f"- spent {fmt_usd(spent)}")
    held = df[df["blocked_by"] != ""]
    if held.empty:
        lines.append("- no trial waited on a budget, quota or queue")
    else:
        longest = held.loc[held["blocked_s"].idxmax()]
        lines.append(
            f"- {len(held)} trials waited on limits, {fmt_duration(held['blocked_s'].sum())} in "
            f"all; longest trial {int(longest['trial'])}, {fmt_duration(longest['blocked_s'])}, "
            f"mostly on {longest['blocked_by']}"
        )
    refused = df[df["state"] != "Completed"]
    for _, row in refused.head(5).iterrows():
        lines.append(f"- trial {int(row['trial'])} {row['state']}: {row['reason'][:200]}")
    return "\n".join(lines)
