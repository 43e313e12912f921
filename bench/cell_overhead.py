"""What nbfleet's gateway adds to a cell's round trip.

The same trivial cell (``x=1``) runs on two kernels in one run: one behind a
standalone ``nbfleet up`` (client -> control plane WebSocket -> agent -> ZMQ ->
kernel) and one driven directly with jupyter_client (client -> ZMQ -> kernel).
Measurements alternate in blocks (ABBA order), so machine noise and drift hit
both sides alike, and the difference is the gateway's cost rather than the
machine's mood. Each figure is printed as one JSON line on stdout; progress and
a readable summary go to stderr.

    .venv/bin/python bench/cell_overhead.py --cells 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import direct_kernel, emit, gateway_kernel, nbfleet_up, p95, stderr
from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "cell_overhead"
CELL = "x=1"
REPLY_TIMEOUT_S = 30.0
TARGET_ADDED_MEDIAN_MS = 3.0

#: One cell's round trip, in seconds: execute_request sent -> its execute_reply read.
RoundTrip = Callable[[], Awaitable[float]]


# ------------------------------------------------------------------ nbfleet side
def gateway_round_trip(sock: KernelSocket) -> RoundTrip:
    async def one() -> float:
        request = sock.message("execute_request", {
            "code": CELL, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}, "shell")
        msg_id = request["header"]["msg_id"]
        start = time.perf_counter()
        await sock.send(request)
        while True:  # iopub frames (busy, execute_input, idle) interleave: skip them
            msg = await sock.receive(REPLY_TIMEOUT_S)
            if msg["channel"] == "shell" and msg["parent_header"].get("msg_id") == msg_id:
                return time.perf_counter() - start

    return one


# ------------------------------------------------------------------- direct side
def direct_round_trip(client: AsyncKernelClient) -> RoundTrip:
    async def one() -> float:
        start = time.perf_counter()
        msg_id = client.execute(CELL)
        while True:
            msg: dict[str, Any] = await client.get_shell_msg(timeout=REPLY_TIMEOUT_S)
            if msg["parent_header"].get("msg_id") == msg_id:
                return time.perf_counter() - start

    return one


# ---------------------------------------------------------------------- measuring
def block_sizes(cells: int, blocks: int) -> list[int]:
    base, extra = divmod(cells, blocks)
    return [base + (1 if i < extra else 0) for i in range(blocks)]


async def measure(sides: dict[str, RoundTrip], cells: int, blocks: int,
                  warmup: int) -> dict[str, list[float]]:
    """Round trips in seconds per side, alternating sides block by block (ABBA...)."""
    names = list(sides)
    for name in names:
        for _ in range(warmup):
            await sides[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("measuring", total=cells * len(names))
        for index, size in enumerate(block_sizes(cells, blocks)):
            for name in names if index % 2 == 0 else reversed(names):
                progress.update(task, description=f"{name:>7} block {index + 1}/{blocks}")
                for _ in range(size):
                    samples[name].append(await sides[name]())
                    progress.advance(task)
    return samples


def figures(direct: list[float], gateway: list[float]) -> dict[str, float]:
    ms = 1000.0
    d_med, d_p95 = statistics.median(direct) * ms, p95(direct) * ms
    g_med, g_p95 = statistics.median(gateway) * ms, p95(gateway) * ms
    return {
        "direct_median_ms": d_med,
        "direct_p95_ms": d_p95,
        "gateway_median_ms": g_med,
        "gateway_p95_ms": g_p95,
        "added_median_ms": g_med - d_med,
        "added_p95_ms": g_p95 - d_p95,
        "ratio_median": g_med / d_med,
    }


def report(result: dict[str, float], cells: int, blocks: int) -> None:
    for name, value in result.items():
        emit(BENCH, name, value)
    verdict = "met" if result["added_median_ms"] <= TARGET_ADDED_MEDIAN_MS else "NOT met"
    print(
        f"{BENCH}: {cells} cells per side in {blocks} alternating blocks | "
        f"direct median {result['direct_median_ms']:.2f} ms, p95 {result['direct_p95_ms']:.2f} ms"
        f" | gateway median {result['gateway_median_ms']:.2f} ms, "
        f"p95 {result['gateway_p95_ms']:.2f} ms | added {result['added_median_ms']:+.2f} ms "
        f"median (x{result['ratio_median']:.2f}), {result['added_p95_ms']:+.2f} ms p95 | "
        f"target <= {TARGET_ADDED_MEDIAN_MS:g} ms added at the median: {verdict}",
        file=sys.stderr, flush=True,
    )


async def run(args: argparse.Namespace, home: Path, direct_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        url = stack.enter_context(nbfleet_up(home))
        sock, _ = await gateway_kernel(url, home)
        stack.push_async_callback(sock.close)
        client = await stack.enter_async_context(direct_kernel(direct_dir))
        samples = await measure(
            {"direct": direct_round_trip(client), "gateway": gateway_round_trip(sock)},
            args.cells, args.blocks, args.warmup,
        )
    report(figures(samples["direct"], samples["gateway"]), args.cells, args.blocks)


async def main_async(args: argparse.Namespace, home: Path, direct_dir: Path) -> None:
    """Run with SIGTERM/SIGINT turned into cancellation, so the cleanup still happens."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    await run(args, home, direct_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Round trip of a trivial cell through nbfleet's gateway vs. a kernel "
                    "driven directly with jupyter_client. Prints one JSON line per figure.")
    parser.add_argument("--cells", type=int, default=500,
                        help="measured cells per side (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=5,
                        help="alternating blocks the cells are split into (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=50,
                        help="unmeasured cells per side first (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.cells < args.blocks or args.blocks < 1 or args.warmup < 0:
        parser.error("need --cells >= --blocks >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbfleet-bench-") as tmp:
        home, direct_dir = Path(tmp) / "home", Path(tmp) / "direct"
        home.mkdir()
        direct_dir.mkdir()
        try:
            asyncio.run(main_async(args, home, direct_dir))
        except asyncio.CancelledError:
            stderr.print("interrupted; cleaned up")
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
