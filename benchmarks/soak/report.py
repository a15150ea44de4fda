"""The soak's report: its figures as text and markdown tables."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.harness.report import num, table
from benchmarks.soak.config import STREAMS

LATENCY_HEADER = ["Operation", "Samples s/e", "p50 start", "p50 end", "p95 start", "p95 end"]
AGENT_HEADER = ["Agent", "RSS start", "RSS end", "RSS max", "Growth", "KiB/min"]
AGENT_HEADER += ["Pool s/e", "FDs s/e", "Threads s/e", "Out after"]


def latency_rows(latency: dict[str, Any]) -> list[list[str]]:
    return [
        [
            STREAMS[k],
            f"{v['start']['n']} / {v['end']['n']}",
            *(num(v[w]["p50_ms"]) for w in ("start", "end")),
            *(num(v[w]["p95_ms"]) for w in ("start", "end")),
            num(v["ratio"], 2),
        ]
        for k, v in latency.items()
    ]


def agent_rows(agents: list[dict[str, Any]]) -> list[list[str]]:
    def pair(figure: dict[str, Any]) -> str:
        return f"{num(figure['start'], 0)} / {num(figure['end'], 0)}"

    return [
        [
            str(a["index"]),
            *(num(a[k]) for k in ("rss_start_mib", "rss_end_mib", "rss_max_mib")),
            num(a["rss_growth_mib"], 2),
            num(a["rss_slope_kib_per_min"], 0),
            *(pair(a[k]) for k in ("pool", "fds", "threads")),
            "-" if a["final"] is None else str(a["final"]["pool_out"]),
        ]
        for a in agents
    ]


def target_rows(found: dict[str, Any]) -> list[list[str]]:
    def shown(value: Any) -> str:
        return json.dumps(value) if isinstance(value, dict | list) else num(value, 2)

    return [
        [name, shown(t["value"]), t["target"], "ok" if t["ok"] else "MISSED"]
        for name, t in found.items()
    ]


def report(out: dict[str, Any]) -> str:
    cfg, tot, w, ledger = out["config"], out["totals"], out["windows"], out["ledger"]
    pg, srv = out["pg_backends"], out["prefect_server_mib"]
    sections = [
        f"Soak: {cfg['minutes']:g} min, {cfg['agents']} agents (separate processes), ledger on "
        f"PostgreSQL ({cfg['url']}), Prefect server on PostgreSQL; {out['cpus']} CPUs, 1-min "
        f"load {out['load_avg_1m_at_start']:.2f} at start, {out['load_avg_1m_at_end']:.2f} at end; "
        f"job mix {', '.join(f'{k} {v}' for k, v in cfg['mix'].items())}",
        "",
        f"Jobs: {tot['submitted']} submitted, {tot['admitted']} admitted "
        f"({tot['admissions_per_s']:.1f}/s; {tot['admitted_without_wait']} without waiting), "
        f"{tot['completed']} completed, "
        f"{tot['withdrawn']} withdrawn before start, {tot['interrupted']} cancelled while "
        f"waiting, {tot['timed_out']} timed out (own max_wait), {tot['starved']} starved, "
        f"{tot['stuck']} stuck at the end, "
        f"{tot['rejected']} rejected, {tot['errors']} errors; {tot['prefect_limit_waits']} waits "
        "on Prefect limits after the ledger admitted.",
        f"Ledger decisions per second: {out['throughput']['start_per_s']:.1f} in the start "
        f"window, {out['throughput']['end_per_s']:.1f} in the end window.",
        "",
        f"Latency (ms). Start window {w['start'][0]:.0f}-{w['start'][1]:.0f} s, end window "
        f"{w['end'][0]:.0f}-{w['end'][1]:.0f} s into the run ({w['warmup_s']:.0f} s warm-up "
        "left out). A window's p95 is the median of the p95s of up to 5 consecutive groups of "
        ">= 20 samples (none under 20 samples).",
        "",
        table([*LATENCY_HEADER, "p95 end/start"], latency_rows(out["latency"])),
        "",
        "admit, not waiting: Gate.admit wall time for jobs admitted at their first decision "
        "(record + decide, Prefect limits of 3 scopes, lease recorded, heartbeat started). "
        "admit after a wait: from the start of the decision that admitted a waiting job to "
        "admit's return.",
        "",
        "Per agent: medians over the start and end windows (MiB); KiB/min: least-squares RSS "
        "slope after warm-up; pool: the ledger's idle + checked-out connections; out after: "
        "checked out once the run ended.",
        "",
        table(AGENT_HEADER, agent_rows(out["agents"])),
        "",
        f"Gate backends in PostgreSQL, all agents: {num(pg['start'], 0)} at the start, "
        f"{num(pg['end'], 0)} at the end (max {num(pg['early_max'], 0)} in the first half, "
        f"{num(pg['max'], 0)} overall). Prefect server RSS {num(srv['start'])} -> "
        f"{num(srv['end'])} MiB.",
        "Per minute, trend over the run: "
        + "; ".join(
            f"{name} {num(v['per_minute'][0])} -> {num(v['per_minute'][-1])} "
            f"(trend {num(v['trend_pct'], 0, '%')})"
            for name, v in out["host_and_db"].items()
        )
        + ".",
        "",
        f"Ledger after the run: {ledger['rows']} jobs {ledger['by_state']}, settled outcomes "
        f"{ledger['settled_outcomes']}, spend ${ledger['spend_usd']:.2f}; "
        f"{len(ledger['problems'])} problems; Prefect slots left taken: "
        f"{ledger['leaked_slots'] or 'none'}.",
        *[f"- {p}" for p in ledger["problems"]],
        *[f"- {e}" for e in out["errors"]],
        *[f"- agent {i} log: {t}" for i, t in out["agent_logs"].items()],
        "",
        "Targets",
        "",
        table(["Figure", "Value", "Target", ""], target_rows(out["targets"])),
        "",
        f"Total wall time {out['wall_s']:.0f} s.",
    ]
    return "\n".join(sections)
