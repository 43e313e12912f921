"""What a workspace keeps in the blob store as its cells change a value, and what
the suspend that collects the replaced values costs.

On a fresh ``nbfleet up`` (control plane, agent and kernel on loopback, a
directory blob store), a kernel holds a ``--size-mb`` array that ``--cells`` cells
each replace with new random bytes; each cell's checkpoint stores the new value.
Reported, per ``--rounds`` round of those cells then a suspend and a resume:

- the workspace's bytes in the store before the suspend (every replaced value is
  still there) and after it (what the snapshot names, plus at most what the one
  before it named);
- the suspend's time, against a baseline suspend in the same run of a second
  workspace holding the same array, whose cells (as many, each checkpointed) never
  replace it: nothing to collect;
- that the resumed kernel holds the last value (its digest).

One JSON line per figure on stdout (``{"bench": "collection", "figure", "value"}``).

    .venv/bin/python bench/collection.py
    .venv/bin/python bench/collection.py --size-mb 50 --cells 10 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

from harness import channels_url, measured, nbfleet_up, stderr, workspace_kernel
from nbfleet.sdk.kernel_socket import KernelSocket
from resume_load import run_cell, timed

BENCH = "collection"
DIGEST = "import hashlib; print(hashlib.sha256(value.tobytes()).hexdigest())"
#: The baseline's cells: a checkpoint each, as the changing side's, and no value replaced.
SAME = "i = globals().get('i', 0) + 1"


def stored_bytes(home: Path, workspace: str) -> int:
    top = home / "blobs" / "workspaces" / workspace
    return sum(p.stat().st_size for folder in ("cas", "snapshots")
               for p in (top / folder).rglob("*") if p.is_file())


async def checkpointed(http: httpx.AsyncClient, workspace: str, kernel: str,
                       cell: int) -> None:
    """Wait until the kernel's saved state includes ``cell`` (the API's snapshot)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body = (await http.get(f"/v1/workspaces/{workspace}")).json()
        cells = (body.get("snapshot") or {}).get("cells") or {}
        if int(cells.get(kernel) or 0) >= cell:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"cell {cell} of {kernel} was not checkpointed")


async def run(args: argparse.Namespace, root: Path) -> dict[str, float]:
    home = root / "home"
    home.mkdir()
    make = (f"import numpy as np\nrng = np.random.default_rng(1)\n"
            f"value = rng.integers(0, 255, {args.size_mb} << 20, dtype=np.uint8)")
    change = f"value = rng.integers(0, 255, {args.size_mb} << 20, dtype=np.uint8)"
    with nbfleet_up(home, "--idle-suspend", "0") as url:
        changing, kernel, workspace, token = await workspace_kernel(url, home, "changing")
        still, base_kernel, baseline, base_token = await workspace_kernel(url, home, "still")
        await run_cell(changing, make)
        await run_cell(still, make)
        await changing.close()
        await still.close()
        before, after, collecting, plain = [], [], [], []
        count = 1  # cells each kernel has run
        async with httpx.AsyncClient(base_url=url, timeout=600,
                                     headers={"Authorization": f"Bearer {token}"}) as http, \
                httpx.AsyncClient(base_url=url, timeout=600,
                                  headers={"Authorization": f"Bearer {base_token}"}) as base:
            sides = ((http, workspace, kernel, token, change),
                     (base, baseline, base_kernel, base_token, SAME))
            for round_ in range(args.rounds):
                expected = []
                for client, ws, kid, tok, cell in sides:
                    sock = await KernelSocket.connect(channels_url(url, ws, kid), tok)
                    for n in range(args.cells):
                        await run_cell(sock, cell)
                        await checkpointed(client, ws, kid, count + n + 1)
                    expected.append(await run_cell(sock, DIGEST))
                    await sock.close()
                count += args.cells + 1
                before.append(stored_bytes(home, workspace))
                took, _ = await timed(http, f"/v1/workspaces/{workspace}/suspend")
                collecting.append(took)
                after.append(stored_bytes(home, workspace))
                took, _ = await timed(base, f"/v1/workspaces/{baseline}/suspend")
                plain.append(took)
                for (client, ws, kid, tok, _), digest in zip(sides, expected, strict=True):
                    await timed(client, f"/v1/workspaces/{ws}/resume")
                    sock = await KernelSocket.connect(channels_url(url, ws, kid), tok)
                    got = await run_cell(sock, DIGEST)
                    await sock.close()
                    if got != digest:
                        raise RuntimeError(f"round {round_}: {ws} resumed with {got!r}, "
                                           f"not {digest!r}")
                count += 1
                stderr.print(f"round {round_ + 1}/{args.rounds}: {before[-1] >> 20} MiB stored "
                             f"before the suspend, {after[-1] >> 20} MiB after; suspend "
                             f"{collecting[-1] * 1000:.0f} ms (baseline {plain[-1] * 1000:.0f})")
    mib, ms = float(1 << 20), 1000.0
    return {
        "value_mib": float(args.size_mb),
        "cells_per_round": float(args.cells),
        "stored_before_suspend_mib_median": statistics.median(before) / mib,
        "stored_after_suspend_mib_median": statistics.median(after) / mib,
        "stored_after_suspend_mib_max": max(after) / mib,
        "suspend_collecting_p50_ms": statistics.median(collecting) * ms,
        "suspend_baseline_p50_ms": statistics.median(plain) * ms,
        "suspend_added_p50_ms": (statistics.median(collecting) - statistics.median(plain)) * ms,
        "rounds_resumed_with_last_value": float(args.rounds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=20, help="the array's size (MiB)")
    parser.add_argument("--cells", type=int, default=10,
                        help="cells that replace it in each round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each then suspended")
    args = parser.parse_args(argv)
    return 0 if measured(BENCH, lambda root: run(args, root)) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
