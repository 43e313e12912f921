"""What output printed with no client connected costs the platform's memory.

On a fresh ``nbfleet up`` (control plane and agent in one process, as a laptop
runs it), a cell starts, its only client disconnects, and the cell prints while
nobody is connected. Two shapes:

- ``flood``: ``--flood-mib`` (default 1024) printed as fast as Python can, 1 MiB
  per write; ipykernel would send each 0.2 s flush as one message;
- ``steady``: ``--steady-mib`` (default 64) at 5 MiB/s, below the kernel's cut,
  so the agent's own bounded backlog (``--output-buffer``, 16 MiB) drops the rest.

Reported for each: the ``nbfleet up`` process's resident memory before the cell,
its peak (VmHWM) growth while the cell ran, its resident memory once the next
client took the output, what that client received, and the ratio of the peak
growth to what was printed (the baseline: holding it all costs at least 1x).

    .venv/bin/python bench/output_flood.py
    .venv/bin/python bench/output_flood.py --flood-mib 256 --steady-mib 32
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx

from harness import SERVER_PIDS, channels_url, measured, nbfleet_up, stderr, workspace_kernel
from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "output_flood"


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


async def _away(url: str, home: Path, name: str, code: str) -> dict[str, float]:
    sock, kernel, workspace, token = await workspace_kernel(url, home, name)
    pid = SERVER_PIDS[url]
    rss_before = _status_kib(pid, "VmRSS")
    peak_before = _status_kib(pid, "VmHWM")
    request = sock.message("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True}, "shell")
    await sock.send(request)
    while (await sock.receive())["msg_type"] != "execute_input":
        pass
    await sock.close()
    async with httpx.AsyncClient(base_url=url, headers={
            "Authorization": f"Bearer {token}"}, timeout=30) as api:
        for _ in range(1200):
            await asyncio.sleep(0.5)
            state = (await api.get(f"/v1/workspaces/{workspace}/api/kernels/{kernel}")).json()
            if state["execution_state"] == "idle":
                break
    peak = _status_kib(pid, "VmHWM")
    again = await KernelSocket.connect(channels_url(url, workspace, kernel), token)
    try:
        result = await again.collect(request["header"]["msg_id"], timeout=120)
    finally:
        await again.close()
    received = sum(len(o["content"]["text"]) for o in result.outputs
                   if o["msg_type"] == "stream")
    return {"rss_before_mib": rss_before / 1024,
            "peak_growth_mib": max(0, peak - max(peak_before, rss_before)) / 1024,
            "rss_after_mib": _status_kib(pid, "VmRSS") / 1024,
            "received_mib": received / (1 << 20)}


async def run(tmp: Path, flood_mib: int, steady_mib: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    with nbfleet_up(tmp, "--warm-pool", "0", "--workspace-disk", "0") as url:
        shapes = {
            "flood": (flood_mib, "import sys\nline = 'x' * ((1 << 20) - 1) + '\\n'\n"
                                 f"for _ in range({flood_mib}):\n    sys.stdout.write(line)\n"),
            "steady": (steady_mib, "import sys, time\nline = 'x' * ((1 << 20) - 1) + '\\n'\n"
                                   f"for _ in range({steady_mib}):\n    sys.stdout.write(line)\n"
                                   "    time.sleep(0.2)\n"),
        }
        for shape, (printed, body) in shapes.items():
            code = "import time\ntime.sleep(1.5)\n" + body + "print('the end')"
            stderr.print(f"{shape}: printing {printed} MiB with no client connected")
            got = await _away(url, tmp, shape, code)
            got["printed_mib"] = printed
            got["peak_over_printed"] = got["peak_growth_mib"] / printed
            figures.update({f"{shape}_{k}": v for k, v in got.items()})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood-mib", type=int, default=1024)
    parser.add_argument("--steady-mib", type=int, default=64)
    args = parser.parse_args()
    measured(BENCH, lambda tmp: run(tmp, args.flood_mib, args.steady_mib))


if __name__ == "__main__":
    main()
