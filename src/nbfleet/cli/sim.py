"""``nbfleet sim``: compare placement policies on a trace, before deploying them."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)
# Wide when piped (docs, CI logs), so the table does not wrap at 80 columns.
out_console = Console(width=None if sys.stdout.isatty() else 200)


def sim(
    trace: str = typer.Option(
        "synthetic:sensei", "--trace",
        help="synthetic:sensei, synthetic:sensei-busy, synthetic:widetail, tiresias:PATH, "
             "native:PATH, or a PATH (.jsonl/.csv)"),
    hours: float = typer.Option(17.5, "--hours", help="Length of a synthetic trace"),
    seed: int = typer.Option(0, "--seed", help="Seed of a synthetic trace"),
    policies: str = typer.Option(
        "all", "--policies", help="all, or a comma-separated list of: "
        "reservation, batch, notebookos, lcp, nbfleet"),
    out: Path = typer.Option(Path("sim-out"), "--out", help="Directory for the outputs"),
    tiresias_sessions: str = typer.Option(
        "infer", "--tiresias-sessions",
        help="infer (a session ends where submit_time drops) or per-job"),
    max_hosts: int | None = typer.Option(None, "--max-hosts", min=1,
                                         help="Cap on the fleet's size"),
    host_gpus: str = typer.Option(
        "8xV100-16GB", "--host-gpus",
        help="GPUs of each host the fleet provisions, e.g. 8xA100-80GB (default: the "
        "paper's p3.16xlarge)"),
    initial_hosts: int = typer.Option(0, "--initial-hosts", min=0,
                                      help="Hosts ready at time zero"),
    immediate_s: float = typer.Option(1.0, "--immediate-s", min=0.0,
                                      help="A task starting within this many seconds "
                                      "counts as started immediately"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots"),
) -> None:
    """Replay a trace through each policy; print a table and write JSON, CSV and PNGs."""
    from nbfleet.model.errors import DomainError
    from nbfleet.model.resources import HostInventory, parse_gpu_spec
    from nbfleet.policy.scheduling.config import P3_16XLARGE
    from nbfleet.sim.compare import resolve_policies, run_policies
    from nbfleet.sim.driver import SimOptions
    from nbfleet.sim.report import results_table, write_outputs
    from nbfleet.sim.summary import Billing
    from nbfleet.sim.traces.model import TraceError
    from nbfleet.sim.traces.source import load_trace

    if tiresias_sessions not in ("infer", "per-job"):
        _fail("--tiresias-sessions must be infer or per-job")
    try:
        groups = parse_gpu_spec(host_gpus)
    except DomainError as exc:
        _fail(f"--host-gpus: {exc.detail}")
    if not groups:
        _fail("--host-gpus must declare at least one GPU")
    per_gpu = P3_16XLARGE.millicpus // P3_16XLARGE.gpu_count, P3_16XLARGE.memory_mb // 8
    count = sum(g.count for g in groups)
    shape = HostInventory(per_gpu[0] * count, per_gpu[1] * count, groups)
    try:
        names = resolve_policies(policies)
        loaded = load_trace(trace, hours=hours, seed=seed,
                            tiresias_sessions="infer" if tiresias_sessions == "infer"
                            else "per-job")
    except (TraceError, ValueError, OSError) as exc:
        _fail(str(exc))
    if not loaded.sessions:
        _fail(f"trace {trace} has no sessions")
    options = SimOptions(initial_hosts=initial_hosts)
    billing = Billing()
    span = max(loaded.duration_s, 1.0)
    with Progress(TextColumn("{task.description:<12}"), BarColumn(),
                  TextColumn("{task.percentage:>3.0f}% of simulated time"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bars = {name: progress.add_task(name, total=span) for name in names}

        def advance(name: str, now: float) -> None:
            progress.update(bars[name], completed=min(span, now - loaded.start_s))

        runs = run_policies(loaded, names, options=options, billing=billing,
                            max_hosts=max_hosts, host_shape=shape, immediate_s=immediate_s,
                            progress=advance)
    out_console.print(results_table(loaded, runs))
    written = write_outputs(out, loaded, runs, options, billing)
    if plots:
        from nbfleet.sim.plots import write_plots

        written += write_plots(out, runs)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)
