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
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "cell_overhead"
CELL = "x=1"
REPLY_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0
TARGET_ADDED_MEDIAN_MS = 3.0

#: One cell's round trip, in seconds: execute_request sent -> its execute_reply read.
RoundTrip = Callable[[], Awaitable[float]]

stderr = Console(stderr=True)


# ------------------------------------------------------------------ nbfleet side
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def nbfleet_up(home: Path) -> Iterator[str]:
    """A whole platform in one subprocess (its own home and port); yields its URL.

    Stopped with SIGTERM, which shuts its kernels down too (they run in sessions of
    their own, so killing the process group would orphan them).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "nbfleet-up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_HOME"] = str(home)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbfleet.cli.main", "up", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        try:
            _wait_healthy(proc, url)
        except BaseException:
            stderr.print(f"nbfleet up log ({log}):\n{_tail(log)}", markup=False)
            raise
        yield url
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"nbfleet up exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nbfleet up did not answer on {url}")
        time.sleep(0.1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(empty)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def gateway_kernel(url: str, home: Path) -> tuple[KernelSocket, str]:
    """A user, a running workspace and a kernel in it; returns its socket and kernel id."""
    admin_token = (home / "admin-token").read_text().strip()
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as http:
        user = await http.post("/v1/admin/users",
                               headers={"Authorization": f"Bearer {admin_token}"},
                               json={"name": "bench", "org": "bench", "project": "bench"})
        user.raise_for_status()
        token: str = user.json()["token"]
        http.headers["Authorization"] = f"Bearer {token}"
        created = await http.post("/v1/workspaces", json={"name": "bench"})
        created.raise_for_status()
        workspace = created.json()["id"]
        deadline = time.monotonic() + START_TIMEOUT_S
        while (state := (await http.get(f"/v1/workspaces/{workspace}")).json()["state"]) \
                != "running":
            if time.monotonic() > deadline:
                raise TimeoutError(f"workspace {workspace} stuck in {state}")
            await asyncio.sleep(0.1)
        started = await http.post(f"/v1/workspaces/{workspace}/api/kernels",
                                  json={"name": "python3"})
        started.raise_for_status()
        kernel_id: str = started.json()["id"]
    ws_url = (url.replace("http", "ws", 1)
              + f"/v1/workspaces/{workspace}/api/kernels/{kernel_id}/channels")
    return await KernelSocket.connect(ws_url, token), kernel_id


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
@contextlib.asynccontextmanager
async def direct_kernel(workdir: Path) -> AsyncIterator[AsyncKernelClient]:
    """The baseline: ipykernel over IPC sockets, as nbfleet's agent runs its kernels."""
    manager = AsyncKernelManager(kernel_name="python3", transport="ipc",
                                 ip=str(workdir / "k"),
                                 connection_file=str(workdir / "kernel.json"))
    await manager.start_kernel(cwd=str(workdir))
    client = manager.client()
    try:
        client.start_channels()
        await client.wait_for_ready(timeout=START_TIMEOUT_S)
        yield client
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


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


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[94]


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
        print(json.dumps({"bench": BENCH, "figure": name, "value": round(value, 3)},
                         separators=(",", ":")), flush=True)
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
