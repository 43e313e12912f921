"""GPU cells (issue 14): what binding GPUs to each cell costs.

Two parts (``--parts``):

* ``decisions``: the scheduling policies the control plane runs (``nbfleet``, the
  default, and ``notebookos``; ``--policies``), each inside the
  :class:`~nbfleet.control.fleet.scheduler.LiveScheduler` the control plane wraps
  it in, with a no-op Effects that only counts what it is asked to do (the live
  one's work per cell is the ledger's, timed by the latency part). ``--hosts``
  hosts of the simulator's shape (8 GPUs each) join, ``--kernels`` GPU kernels
  open (the synthetic Sensei trace's GPU mix: 1/2/4/8 GPUs at 60/20/15/5 %, of
  ``--tenants`` projects with fair-share weights 1/2/4, so waiting cells are
  ordered by the fair queue), each placed by ``open_kernel`` as a workspace start
  places it (3 replicas each);
  their time is ``open_kernel_*``. Later policies with the same placement code and
  knobs get the same placements through ``adopt_kernel`` (the rebuild path) rather
  than placing 10,000 kernels again. Then, on one thread, cells come and go as the
  cell gate drives them, ``acquire`` (bind GPUs, or queue) and ``release`` (free
  them; queued cells may start), keeping ``--load`` of the fleet's GPUs committed
  or asked for, on random kernels; a cell that queues is resumed when a release
  starts it. Per policy and load, after filling the fleet and ``--warmup-cells``:
  ``--blocks`` blocks of ``--block-cells`` bound cells, and
  ``<policy>_load<pct>_decisions_per_s``, the median over blocks of cells bound
  per second of scheduler time (each bind with its release: a cell's whole cost
  to the scheduler), ``_decisions_per_cpu_s`` the same per second of this
  thread's CPU (what one core does, however busy the machine), ``_wall_per_s``
  (the driver's own work included), ``_cpu_share`` (the thread's CPU over wall), and
  ``_bind_p50_us``/``_p99`` and ``_release_p50_us``/``_p99`` per call, with how
  cells started (``_local``, ``_migrate``, ``_queued`` shares) and the cells
  waiting in the queue at a release (``_queue_mean``). A block also ends after
  ``--block-seconds``. Under the target it profiles one block (cProfile), as
  ``--profile`` always does. This part lives in ``gpu_decisions.py``.
* ``latency``: a throwaway ``nbfleet up`` (control plane and one agent with
  ``--gpus 1xA100-80GB`` in one process, SQLite, ``--latency-policy``, default
  ``nbfleet``, ``--warm-pool 0``), one GPU workspace
  (``{"gpus": 1, "gpu_types": ["A100-80GB"]}``, its org granted credit) and one
  without GPUs; the trivial cell of ``cell_overhead.py`` runs ``--cells`` times on
  each through the WebSocket gateway, alternating in blocks (ABBA), timed as
  there. ``no_gpu_*`` and ``gpu_*`` medians and p90, ``added_median_ms`` (the
  difference of medians: queueing in the cell gate, the bind, the credit hold,
  the binding in the request's metadata, the release) and ``ratio_median``;
  ``*_server_cpu_ms``, the CPU the ``nbfleet up`` process spent per cell on each
  side (from ``/proc``, so in 10 ms ticks: a mean over many cells);
  ``gpu_cells_bound`` (the control plane's count of bound cells, from
  ``/metrics``) and ``gpu_cell_sees_gpu`` (1 if the GPU kernel's
  ``CUDA_VISIBLE_DEVICES`` is ``0``) check that the binding really happened.

Targets: at most 2 ms added at the median; at least 2,000 decisions/s on one core
with 1,000 hosts and 10,000 kernels. A table goes to stdout, or with ``--json``
one JSON line per figure (the table then to stderr).

    .venv/bin/python bench/gpu_cells.py
    .venv/bin/python bench/gpu_cells.py --parts decisions --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from cell_overhead import RoundTrip, gateway_round_trip, measure
from gpu_decisions import BENCH, TARGET_DECISIONS_PER_S, run_decisions
from harness import (
    SERVER_PIDS,
    admin_headers,
    emit,
    grant_credits,
    nbfleet_up,
    percentile,
    process_cpu_s,
    stderr,
    workspace_kernel,
)

TARGET_ADDED_MEDIAN_MS = 2.0
GPU_RESOURCES = {"gpus": 1, "gpu_types": ["A100-80GB"]}
MICRO_CREDITS = 1_000_000
SHOW_GPUS = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"


# ------------------------------- part 2: latency (part 1, decisions: gpu_decisions.py)
async def cells_bound(url: str, home: Path) -> float:
    """The control plane's count of GPU cells that got their GPUs."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        response = await http.get("/metrics", headers=admin_headers(home))
        response.raise_for_status()
    for line in response.text.splitlines():
        if line.startswith("nbfleet_cell_gpu_wait_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def with_server_cpu(one: RoundTrip, pid: int, spent: list[float]) -> RoundTrip:
    """``one``, adding the server process's CPU over each round trip to ``spent``."""
    async def timed() -> float:
        before = process_cpu_s(pid)
        elapsed = await one()
        spent.append(process_cpu_s(pid) - before)
        return elapsed

    return timed


async def run_latency(args: argparse.Namespace, home: Path) -> dict[str, float]:
    async with contextlib.AsyncExitStack() as stack:
        url = stack.enter_context(nbfleet_up(home, "--gpus", "1xA100-80GB", "--policy",
                                             args.latency_policy, "--warm-pool", "0"))
        gpu, _, _, _ = await workspace_kernel(url, home, name="gpu", resources=GPU_RESOURCES)
        stack.push_async_callback(gpu.close)
        await grant_credits(url, home, "gpu", 1000 * MICRO_CREDITS)
        plain, _, _, _ = await workspace_kernel(url, home, name="plain")
        stack.push_async_callback(plain.close)
        seen = {name: (await sock.execute(SHOW_GPUS)).stdout.strip()
                for name, sock in (("gpu", gpu), ("no_gpu", plain))}
        if seen != {"gpu": "0", "no_gpu": "unset"}:
            raise RuntimeError(f"the kernels see the wrong GPUs: {seen}")
        before = await cells_bound(url, home)
        cpu: dict[str, list[float]] = {"no_gpu": [], "gpu": []}
        pid = SERVER_PIDS[url]
        samples = await measure(
            {"no_gpu": with_server_cpu(gateway_round_trip(plain), pid, cpu["no_gpu"]),
             "gpu": with_server_cpu(gateway_round_trip(gpu), pid, cpu["gpu"])},
            args.cells, args.latency_blocks, args.warmup)
        bound = await cells_bound(url, home) - before
    ms = {name: [s * 1000 for s in values] for name, values in samples.items()}
    result: dict[str, float] = {}
    for name in ("no_gpu", "gpu"):
        result[f"{name}_median_ms"] = statistics.median(ms[name])
        result[f"{name}_p90_ms"] = percentile(ms[name], 90)
        measured = cpu[name][args.warmup:]  # the server's CPU per cell, warm-up left out
        result[f"{name}_server_cpu_ms"] = sum(measured) * 1000 / len(measured)
    result["added_median_ms"] = result["gpu_median_ms"] - result["no_gpu_median_ms"]
    result["added_p90_ms"] = result["gpu_p90_ms"] - result["no_gpu_p90_ms"]
    result["ratio_median"] = result["gpu_median_ms"] / result["no_gpu_median_ms"]
    result["added_server_cpu_ms"] = result["gpu_server_cpu_ms"] - result["no_gpu_server_cpu_ms"]
    result["gpu_cells_bound"] = bound
    result["gpu_cell_sees_gpu"] = 1.0
    verdict = "met" if result["added_median_ms"] <= TARGET_ADDED_MEDIAN_MS else "NOT met"
    stderr.print(
        f"{BENCH}: {args.latency_policy}, {args.cells} cells per side in "
        f"{args.latency_blocks} alternating blocks | no GPU median "
        f"{result['no_gpu_median_ms']:.2f} ms, p90 {result['no_gpu_p90_ms']:.2f} | GPU median "
        f"{result['gpu_median_ms']:.2f} ms, p90 {result['gpu_p90_ms']:.2f} | added "
        f"{result['added_median_ms']:+.2f} ms median (x{result['ratio_median']:.2f}); server "
        f"CPU per cell {result['no_gpu_server_cpu_ms']:.2f} vs "
        f"{result['gpu_server_cpu_ms']:.2f} ms; {bound:.0f} cells bound | target <= "
        f"{TARGET_ADDED_MEDIAN_MS:g} ms: {verdict}", highlight=False)
    return result


# ------------------------------------------------------------------------ main
def table(results: dict[str, float], console: Console) -> None:
    view = Table(title=f"{BENCH} (targets: added latency <= {TARGET_ADDED_MEDIAN_MS:g} ms "
                       f"at the median; >= {TARGET_DECISIONS_PER_S:,.0f} decisions/s)")
    view.add_column("figure")
    view.add_column("value", justify="right")
    view.add_column("target")
    for name, value in results.items():
        target = ""
        if name == "latency_added_median_ms":
            target = "met" if value <= TARGET_ADDED_MEDIAN_MS else "NOT met"
        elif name.endswith(("_decisions_per_s", "_decisions_per_cpu_s")):
            target = "met" if value >= TARGET_DECISIONS_PER_S else "NOT met"
        view.add_row(name, f"{value:,.3f}".rstrip("0").rstrip("."), target)
    console.print(view)


async def main_async(args: argparse.Namespace, home: Path) -> dict[str, float]:
    """Run with SIGTERM/SIGINT turned into cancellation, so the cleanup still happens."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    results: dict[str, float] = {}
    for part in args.parts:
        stderr.print(f"{BENCH}: {part}", highlight=False)
        figures = await (run_decisions(args) if part == "decisions" else run_latency(args, home))
        results |= {f"{part}_{name}": value for name, value in figures.items()}
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="GPU cells: the latency per-cell GPU binding adds (against a workspace "
                    "without GPUs in the same run) and the scheduler's binding decisions "
                    "per second with a large fleet.")
    parser.add_argument("--parts", default="decisions,latency",
                        help="comma-separated, of decisions, latency (default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON line per figure on stdout (the table goes to stderr)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: everything small")
    dec = parser.add_argument_group("decisions")
    dec.add_argument("--policies", default="nbfleet,notebookos", help="(default: %(default)s)")
    dec.add_argument("--hosts", type=int, default=1000, help="(default: %(default)s)")
    dec.add_argument("--kernels", type=int, default=10_000, help="(default: %(default)s)")
    dec.add_argument("--tenants", type=int, default=50,
                     help="projects the kernels belong to, in turn, of weights 1, 2 and 4: "
                          "the fair queue orders their waiting cells (default: %(default)s)")
    dec.add_argument("--load", default="0.5,0.9",
                     help="shares of the fleet's GPUs kept committed or asked for, "
                          "comma-separated (default: %(default)s)")
    dec.add_argument("--blocks", type=int, default=5, help="(default: %(default)s)")
    dec.add_argument("--block-cells", type=int, default=5000,
                     help="cells bound per block (default: %(default)s)")
    dec.add_argument("--block-seconds", type=float, default=10.0,
                     help="a block (and the warm-up) ends after this long even when short "
                          "of --block-cells (default: %(default)s)")
    dec.add_argument("--warmup-cells", type=int, default=5000, help="(default: %(default)s)")
    dec.add_argument("--seed", type=int, default=7, help="(default: %(default)s)")
    dec.add_argument("--profile", action="store_true",
                     help="profile one block per policy and load even when on target")
    lat = parser.add_argument_group("latency")
    lat.add_argument("--latency-policy", default="nbfleet",
                     help="the control plane's --policy (default: %(default)s)")
    lat.add_argument("--cells", type=int, default=500,
                     help="measured cells per side (default: %(default)s)")
    lat.add_argument("--latency-blocks", type=int, default=10,
                     help="alternating blocks the cells are split into (default: %(default)s)")
    lat.add_argument("--warmup", type=int, default=50,
                     help="unmeasured cells per side first (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hosts, args.kernels = 100, 1000
        args.blocks, args.block_cells, args.warmup_cells = 2, 1000, 500
        args.block_seconds = 2.0
        args.cells, args.latency_blocks, args.warmup = 50, 2, 5
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or set(args.parts) - {"decisions", "latency"}:
        parser.error("--parts takes a comma-separated list of decisions, latency")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        args.load = [float(x) for x in args.load.split(",") if x.strip()]
    except ValueError:
        parser.error("--load takes comma-separated numbers")
    if not args.load or not all(0 < x < 1 for x in args.load):
        parser.error("--load takes shares between 0 and 1")
    counts = (args.hosts, args.kernels, args.tenants, args.blocks, args.block_cells,
              args.latency_blocks)
    if min(counts) < 1 or args.cells < args.latency_blocks or args.block_seconds <= 0 \
            or min(args.warmup, args.warmup_cells) < 0:
        parser.error("counts must be at least 1 (--cells at least --latency-blocks)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbfleet-bench-gpu-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        try:
            results = asyncio.run(main_async(args, home))
        except asyncio.CancelledError:
            stderr.print("interrupted; cleaned up")
            return 130
    if args.json:
        for name, value in results.items():
            emit(BENCH, name, value)
    table(results, stderr if args.json else Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
