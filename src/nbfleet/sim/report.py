"""Simulation outputs: a JSON summary, CSV time series and task records, a rich table."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from nbfleet.sim.compare import PolicyRun
from nbfleet.sim.driver import SimOptions
from nbfleet.sim.metrics import Meters
from nbfleet.sim.summary import Billing, path_counts
from nbfleet.sim.traces.model import Trace

TIMESERIES_COLUMNS = (
    "policy", "hours", "hosts", "provisioning", "gpus_provisioned", "gpus_committed",
    "gpus_busy", "subscribed_gpus", "subscription_ratio", "open_sessions", "kernels",
    "running", "queued", "warm", "migrations", "scaled_out_hosts", "scaled_in_hosts",
)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def summary_document(trace: Trace, runs: dict[str, PolicyRun], options: SimOptions,
                     billing: Billing) -> dict[str, Any]:
    return {
        "trace": {"name": trace.name, "sessions": len(trace.sessions),
                  "tasks": trace.task_count, "hours": trace.duration_s / 3600.0,
                  "reserved_gpu_hours": trace.reserved_gpu_hours(),
                  "busy_gpu_hours": trace.busy_gpu_hours()},
        "latencies_s": asdict(options.latencies),
        "billing": asdict(billing),
        "policies": {
            name: {**{k: _finite(v) for k, v in run.summary.as_dict().items()},
                   "billing_kind": run.billing_kind, "start_paths": path_counts(run.meters),
                   "wall_s": run.wall_s, "events_per_s": run.events_per_s}
            for name, run in runs.items()},
    }


def busy_gpus_at(meters: Meters, moments: list[float]) -> list[int]:
    """GPUs executing tasks at each moment (sorted ``moments``), by a sweep."""
    changes: list[tuple[float, int]] = []
    for r in meters.tasks.values():
        if r.start_s is not None and r.end_s is not None:
            changes += [(r.start_s, r.gpus), (r.end_s, -r.gpus)]
    changes.sort()
    out, busy, i = [], 0, 0
    for moment in moments:
        while i < len(changes) and changes[i][0] <= moment:
            busy += changes[i][1]
            i += 1
        out.append(busy)
    return out


def write_outputs(out_dir: Path, trace: Trace, runs: dict[str, PolicyRun],
                  options: SimOptions, billing: Billing) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "summary.json"
    summary.write_text(json.dumps(summary_document(trace, runs, options, billing), indent=2)
                       + "\n")
    series = out_dir / "timeseries.csv"
    with series.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TIMESERIES_COLUMNS)
        for name, run in runs.items():
            meters = run.meters
            busy = busy_gpus_at(meters, [s.at for s in meters.samples])
            for sample, gpus_busy in zip(meters.samples, busy, strict=True):
                f = sample.fleet
                writer.writerow([
                    name, f"{(sample.at - meters.start) / 3600:.4f}", f.hosts, f.provisioning,
                    (f.hosts + f.provisioning) * meters.gpus_per_host, f.committed_gpus,
                    gpus_busy, f.subscribed_gpus, f"{f.subscription_ratio:.4f}",
                    sample.open_sessions, f.kernels, f.running, f.queued, f.warm,
                    sample.migrations, sample.scaled_out_hosts, sample.scaled_in_hosts])
    tasks = out_dir / "tasks.csv"
    with tasks.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(("policy", "task", "gpus", "submit_s", "eligible_s", "start_s",
                         "end_s", "delay_s", "tct_s", "path", "unschedulable"))
        for name, run in runs.items():
            for r in run.meters.tasks.values():
                writer.writerow((name, r.id, r.gpus, r.submit_s, r.eligible_s, r.start_s,
                                 r.end_s, r.delay_s, r.tct_s,
                                 r.path.value if r.path else "", r.unschedulable or ""))
    return [summary, series, tasks]


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def results_table(trace: Trace, runs: dict[str, PolicyRun]) -> Table:
    table = Table(title=f"{trace.name}: {len(trace.sessions)} sessions, "
                        f"{trace.task_count} tasks, {trace.duration_s / 3600:.1f} h")
    for header in ("policy", "immediate", "delay p50/p90/p99/max s", "8-GPU immediate",
                   "TCT p50/p99 s",
                   "GPU-h prov.", "GPU-h busy", "util.", "peak hosts", "migr.",
                   "scale out/in", "cost $", "revenue $", "unsched."):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for name, run in runs.items():
        s = run.summary
        table.add_row(
            name, f"{s.immediate_fraction:.1%}",
            "/".join(_seconds(v) for v in (s.delay_p50_s, s.delay_p90_s, s.delay_p99_s,
                                           s.delay_max_s)),
            (f"{s.by_width[8]['immediate_fraction']:.1%}" if 8 in s.by_width else "-"),
            "/".join(_seconds(v) for v in (s.tct_p50_s, s.tct_p99_s)),
            f"{s.gpu_hours_provisioned:,.0f}", f"{s.gpu_hours_busy:,.0f}",
            f"{s.utilization:.0%}", str(s.peak_hosts), str(s.migrations),
            f"{s.scale_out_hosts}/{s.scale_in_hosts}", f"{s.cost_usd:,.0f}",
            f"{s.revenue_usd:,.0f}", str(s.unschedulable))
    return table
