"""What the kernel sandbox costs, and what its CPU limit buys a neighbour.

Three figures, each against a baseline from the same run:

- **Neighbour slowdown.** A CPU-bound cell in one workspace, timed with the other
  workspace idle and then with 8 busy loops running in it. Measured on a sandboxed
  platform (each workspace its own cgroup, a 1-CPU limit) and on a bare one
  (``--sandbox none``: plain processes, how every workspace ran before): the ratio
  of medians is the slowdown.
- **Cell overhead.** The round trip of a trivial cell through the gateway to a
  sandboxed kernel and to an unsandboxed one (``--sandbox none``), alternating in
  blocks (ABBA) so the machine's noise hits both alike.
- **Cold kernel start.** ``POST /api/kernels`` (which answers once the kernel is
  ready) with and without the sandbox, alternating.

Each figure is one JSON line on stdout; progress and a summary go to stderr.

    .venv/bin/python bench/isolation.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cell_overhead import gateway_round_trip, measure
from harness import emit, nbfleet_up, stderr, workspace_kernel
from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "isolation"
#: A pure-Python loop of about a quarter of a second on this machine.
NEIGHBOUR_CELL = "sum(i * i for i in range(3_000_000))"
TARGET_SLOWDOWN = 1.3
TARGET_ADDED_MS = 3.0


def hog_cell(loops: int, seconds: float) -> str:
    """Start ``loops`` busy processes that stop by themselves after ``seconds``.

    Each starts a session of its own, as a hostile user would: the scheduler's
    autogroups give each session an equal share, so busy loops in one session
    would only ever take one session's share.
    """
    return f"""import os, time
_end = time.monotonic() + {seconds}
for _ in range({loops}):
    if os.fork() == 0:
        os.setsid()
        while time.monotonic() < _end:
            pass
        os._exit(0)
"""


async def timed(sock: KernelSocket, code: str) -> float:
    start = time.perf_counter()
    result = await sock.execute(code, timeout=120)
    if result.status != "ok":
        raise RuntimeError(f"cell failed: {result.reply}")
    return time.perf_counter() - start


async def neighbour_slowdown(url: str, home: Path, runs: int, loops: int) -> dict[str, float]:
    """Median of the neighbour's cell, quiet and beside the hog; and their ratio."""
    neighbour, _, _, _ = await workspace_kernel(url, home)
    hog, _, _, _ = await workspace_kernel(url, home, name="hog")
    try:
        await timed(neighbour, NEIGHBOUR_CELL)  # warm up
        quiet = [await timed(neighbour, NEIGHBOUR_CELL) for _ in range(runs)]
        seconds = 4.0 + runs * max(quiet) * 6
        await timed(hog, hog_cell(loops, seconds))
        await asyncio.sleep(0.5)
        busy = [await timed(neighbour, NEIGHBOUR_CELL) for _ in range(runs)]
        await timed(hog, "import os\nwhile True:\n    try:\n        os.wait()\n"
                         "    except ChildProcessError:\n        break")
    finally:
        await neighbour.close()
        await hog.close()
    quiet_ms, busy_ms = statistics.median(quiet) * 1e3, statistics.median(busy) * 1e3
    return {"quiet_median_ms": quiet_ms, "busy_median_ms": busy_ms,
            "slowdown": busy_ms / quiet_ms}


async def cold_starts(urls: dict[str, str], homes: dict[str, Path],
                      rounds: int) -> dict[str, list[float]]:
    """Seconds per kernel start on each platform, alternating sides each round."""
    clients: dict[str, tuple[httpx.AsyncClient, str]] = {}
    for name, url in urls.items():
        sock, kernel_id, workspace, token = await workspace_kernel(url, homes[name],
                                                                   name="starts")
        await sock.close()
        http = httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"Authorization": f"Bearer {token}"})
        await http.delete(f"/v1/workspaces/{workspace}/api/kernels/{kernel_id}")
        clients[name] = (http, workspace)
    samples: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for index in range(rounds):
            for name in list(urls) if index % 2 == 0 else reversed(list(urls)):
                http, workspace = clients[name]
                start = time.perf_counter()
                response = await http.post(f"/v1/workspaces/{workspace}/api/kernels",
                                           json={"name": "python3"})
                response.raise_for_status()
                samples[name].append(time.perf_counter() - start)
                await http.delete(f"/v1/workspaces/{workspace}/api/kernels/"
                                  f"{response.json()['id']}")
    finally:
        for http, _ in clients.values():
            await http.aclose()
    return samples


async def run(args: argparse.Namespace, root: Path) -> None:
    """Two platforms side by side: one sandboxed with a 1-CPU limit per workspace,
    one bare (``--sandbox none``: kernels as plain processes, as before limits)."""
    homes = {name: root / name for name in ("sandboxed", "bare")}
    for home in homes.values():
        home.mkdir()
    with contextlib.ExitStack() as stack:
        urls = {
            "sandboxed": stack.enter_context(nbfleet_up(
                homes["sandboxed"], "--sandbox", "bwrap", "--warm-pool", "0",
                "--kernel-cpus", "1", "--kernel-memory", "2GiB", "--kernel-pids", "512",
                "--workspace-disk", "1GiB")),
            "bare": stack.enter_context(nbfleet_up(homes["bare"], "--sandbox", "none",
                                                   "--warm-pool", "0")),
        }
        slowdown = {}
        for name in ("sandboxed", "bare"):
            stderr.print(f"neighbour slowdown: {name}")
            result = await neighbour_slowdown(urls[name], homes[name], args.runs, args.loops)
            slowdown[name] = result["slowdown"]
            for figure, value in result.items():
                emit(BENCH, f"neighbour_{name}_{figure}", value)
        stderr.print("cell overhead: sandboxed vs bare kernel")
        socks = {name: (await workspace_kernel(urls[name], homes[name], name="cells"))[0]
                 for name in ("bare", "sandboxed")}
        try:
            samples = await measure({name: gateway_round_trip(sock)
                                     for name, sock in socks.items()},
                                    args.cells, args.blocks, args.warmup)
        finally:
            for sock in socks.values():
                await sock.close()
        cell = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        emit(BENCH, "cell_bare_median_ms", cell["bare"])
        emit(BENCH, "cell_sandboxed_median_ms", cell["sandboxed"])
        emit(BENCH, "cell_added_median_ms", cell["sandboxed"] - cell["bare"])
        stderr.print("cold kernel starts: sandboxed vs bare")
        starts = await cold_starts({"bare": urls["bare"], "sandboxed": urls["sandboxed"]},
                                   homes, args.starts)
        start = {name: statistics.median(values) * 1e3 for name, values in starts.items()}
        emit(BENCH, "start_bare_median_ms", start["bare"])
        emit(BENCH, "start_sandboxed_median_ms", start["sandboxed"])
        emit(BENCH, "start_ratio_median", start["sandboxed"] / start["bare"])
    limited, bare = slowdown["sandboxed"], slowdown["bare"]
    added = cell["sandboxed"] - cell["bare"]
    print(f"{BENCH}: neighbour slowdown x{limited:.2f} sandboxed with a 1-CPU limit "
          f"(x{bare:.2f} bare; target <= x{TARGET_SLOWDOWN:g}: "
          f"{'met' if limited <= TARGET_SLOWDOWN else 'NOT met'}) | cell "
          f"{cell['bare']:.2f} -> {cell['sandboxed']:.2f} ms median ({added:+.2f} ms; target "
          f"<= {TARGET_ADDED_MS:g} ms: {'met' if added <= TARGET_ADDED_MS else 'NOT met'}) | "
          f"cold start {start['bare']:.0f} -> {start['sandboxed']:.0f} ms median",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9,
                        help="neighbour cells per condition (default: %(default)s)")
    parser.add_argument("--loops", type=int, default=8,
                        help="busy loops in the hog's workspace (default: %(default)s)")
    parser.add_argument("--cells", type=int, default=300,
                        help="trivial cells per side (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--starts", type=int, default=8,
                        help="cold kernel starts per side (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbfleet-bench-") as tmp:
        asyncio.run(run(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
