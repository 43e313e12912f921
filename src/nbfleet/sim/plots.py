"""PNG plots of a comparison, the paper's figures 8, 9, 10 and 12 in our terms."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from nbfleet.sim.compare import PolicyRun
from nbfleet.sim.report import busy_gpus_at

FLOOR_S = 0.01  # zero delays are drawn here, on a log axis


def _cdf(ax: Axes, runs: dict[str, PolicyRun], attribute: str, xlabel: str) -> None:
    for name, run in runs.items():
        values = sorted(max(FLOOR_S, getattr(r, attribute))
                        for r in run.meters.tasks.values() if getattr(r, attribute) is not None)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of tasks")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(out_dir: Path, runs: dict[str, PolicyRun]) -> list[Path]:
    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _cdf(ax, runs, "delay_s", f"interactivity delay, s (0 drawn at {FLOOR_S})")
    ax.set_title("Interactivity delay: eligible to running")
    paths.append(_save(fig, out_dir / "interactivity_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _cdf(ax, runs, "tct_s", "task completion time, s")
    ax.set_title("Task completion time: submit to done")
    paths.append(_save(fig, out_dir / "tct_cdf.png"))

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.2 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        meters = run.meters
        hours = [(s.at - meters.start) / 3600 for s in meters.samples]
        provisioned = [(s.fleet.hosts + s.fleet.provisioning) * meters.gpus_per_host
                       for s in meters.samples]
        busy = busy_gpus_at(meters, [s.at for s in meters.samples])
        ax.fill_between(hours, provisioned, step="post", alpha=0.3, label="provisioned")
        ax.step(hours, busy, where="post", color="C3", label="busy")
        ax.set_ylabel(f"{name}\nGPUs")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("hours")
    fig.suptitle("GPUs provisioned versus busy")
    paths.append(_save(fig, out_dir / "gpus_over_time.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(runs)
    for name, run in runs.items():
        meters = run.meters
        rate = run.summary.cost_usd / max(meters.billed_hosts.hours(meters.end), 1e-9)
        hours, cost, total = [], [], 0.0
        previous = None
        for sample in meters.samples:
            if previous is not None:
                hosts = previous.fleet.hosts + previous.fleet.provisioning
                total += hosts * rate * (sample.at - previous.at) / 3600
            hours.append((sample.at - meters.start) / 3600)
            cost.append(total)
            previous = sample
        left.plot(hours, cost, label=name)
    left.set_xlabel("hours")
    left.set_ylabel("provider cost so far, $")
    left.set_title("Provider cost over time")
    left.legend()
    xs = range(len(names))
    left_bars = [runs[n].summary.cost_usd for n in names]
    right_bars = [runs[n].summary.revenue_usd for n in names]
    right.bar([x - 0.2 for x in xs], left_bars, width=0.4, label="provider cost")
    right.bar([x + 0.2 for x in xs], right_bars, width=0.4, label="revenue (1.15x)")
    right.set_xticks(list(xs), names, rotation=20)
    right.set_ylabel("$")
    right.set_title("Cost and revenue")
    right.legend()
    paths.append(_save(fig, out_dir / "cost.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    twin = ax.twinx()
    for index, (name, run) in enumerate(runs.items()):
        meters = run.meters
        hours = [(s.at - meters.start) / 3600 for s in meters.samples]
        ax.step(hours, [s.fleet.hosts for s in meters.samples], where="post",
                color=f"C{index}", label=f"{name} hosts")
        if run.billing_kind == "replicas":
            twin.plot(hours, [s.fleet.subscription_ratio for s in meters.samples],
                      color=f"C{index}", linestyle=":", label=f"{name} SR")
    ax.set_xlabel("hours")
    ax.set_ylabel("hosts")
    twin.set_ylabel("cluster subscription ratio (dotted)")
    ax.legend(loc="upper left", fontsize="small")
    twin.legend(loc="lower right", fontsize="small")
    ax.set_title("Hosts and subscription ratio over time")
    paths.append(_save(fig, out_dir / "hosts_sr.png"))
    return paths
