"""How soon a file that kernel code writes reaches the blob store (its RPO).

On a fresh ``nbfleet up`` (real control plane, agent and kernel on loopback), a
cell writes a small file with a unique name and content, ``--samples`` times, each
after a random pause within one sync interval (so writes fall at every point of the
agent's scan cycle). The time the cell's execute_reply arrives is the write; the
files API (``GET /v1/workspaces/{ws}/files/{path}``) is then polled every
``--poll-ms`` until it returns that content. Reported: p50/p95/max of (visible -
written), the stated RPO (two sync intervals: a file is uploaded once its stamp was
the same at two scans) and whether the max is within it, and the hard bound
(``MAX_WAIT_ROUNDS`` intervals, for a file that never stops changing).

Then the same files are rewritten with identical bytes (new mtimes): once they had
time to settle, the count of them whose blob was written again (its ``modified``
in the file listing changed) should be 0. As a control, rewriting them with new
bytes of the same size must change all of them.

One JSON line per figure on stdout (``{"bench": "file_rpo", "figure", "value"}``),
figures prefixed ``i<interval>_``; a verdict on stderr.

    .venv/bin/python bench/file_rpo.py --samples 20
    .venv/bin/python bench/file_rpo.py --samples 10 --interval 2 --interval 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from harness import measured, nbfleet_up, p95, stderr, workspace_kernel
from nbfleet.agent.livesync import MAX_WAIT_ROUNDS
from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "file_rpo"
#: Give up on a file that is not visible after this long (far past the hard bound).
GIVE_UP_S = 60.0


async def run_cell(sock: KernelSocket, code: str) -> None:
    result = await sock.execute(code, timeout=120)
    if result.status != "ok":
        raise RuntimeError(f"cell failed: {code[:60]!r}: {result.reply}")


async def visible(http: httpx.AsyncClient, workspace: str, path: str, content: bytes,
                  poll_s: float) -> float:
    """Poll the files API until ``path`` holds ``content``; the monotonic time it did."""
    deadline = time.monotonic() + GIVE_UP_S
    while True:
        got = await http.get(f"/v1/workspaces/{workspace}/files/{path}")
        if got.status_code == 200 and got.content == content:
            return time.monotonic()
        if got.status_code not in (200, 404):
            got.raise_for_status()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} not visible after {GIVE_UP_S:.0f} s")
        await asyncio.sleep(poll_s)


async def modified(http: httpx.AsyncClient, workspace: str) -> dict[str, str]:
    listing = await http.get(f"/v1/workspaces/{workspace}/files")
    listing.raise_for_status()
    return {f["path"]: f["modified"] for f in listing.json()["files"]}


def write_cell(files: dict[str, bytes]) -> str:
    return "".join(f"open({path!r}, 'wb').write({data!r})\n" for path, data in files.items())


async def measure(interval: float, samples: int, poll_s: float, root: Path,
                  rng: random.Random) -> dict[str, float]:
    home = root / f"interval-{interval:g}"
    home.mkdir()
    tag = f"i{interval:g}_"
    with nbfleet_up(home, "--file-sync-interval", f"{interval:g}", "--idle-suspend", "0") as url:
        sock, _, workspace, token = await workspace_kernel(url, home)
        async with httpx.AsyncClient(base_url=url, timeout=30.0,
                                     headers={"Authorization": f"Bearer {token}"}) as http:
            # 1. Latency of new files.
            lags: list[float] = []
            written: dict[str, bytes] = {}
            for index in range(samples):
                path = f"rpo/sample-{index:03d}.txt"
                data = f"sample {index} {rng.getrandbits(64):016x}\n".encode()
                await asyncio.sleep(rng.uniform(0, interval))  # any phase of the scan cycle
                await run_cell(sock, "import os; os.makedirs('rpo', exist_ok=True)\n"
                               + write_cell({path: data}))
                wrote = time.monotonic()
                lags.append(await visible(http, workspace, path, data, poll_s) - wrote)
                written[path] = data
                stderr.print(f"interval {interval:g} s: sample {index + 1}/{samples} "
                             f"visible after {lags[-1] * 1000:.0f} ms")
            # 2. The same bytes written again: nothing uploaded.
            before = await modified(http, workspace)
            await run_cell(sock, write_cell(written))
            await asyncio.sleep(interval * (MAX_WAIT_ROUNDS + 1))  # settled, synced or not
            after = await modified(http, workspace)
            same_bytes = sum(after[path] != before[path] for path in written)
            # 3. Control: new bytes of the same size are uploaded, every one.
            changed = {path: data.swapcase() for path, data in written.items()}
            await run_cell(sock, write_cell(changed))
            for path, data in changed.items():
                await visible(http, workspace, path, data, poll_s)
            control = await modified(http, workspace)
            new_bytes = sum(control[path] != after[path] for path in changed)
        await sock.close()
    ms = 1000.0
    stated = 2 * interval * ms
    return {
        f"{tag}interval_s": interval,
        f"{tag}samples": float(samples),
        f"{tag}rpo_p50_ms": statistics.median(lags) * ms,
        f"{tag}rpo_p95_ms": p95(lags) * ms if samples >= 2 else lags[0] * ms,
        f"{tag}rpo_max_ms": max(lags) * ms,
        f"{tag}rpo_stated_ms": stated,
        f"{tag}rpo_max_within_stated": float(max(lags) * ms <= stated),
        f"{tag}rpo_hard_bound_ms": MAX_WAIT_ROUNDS * interval * ms,
        f"{tag}identical_rewrite_files": float(len(written)),
        f"{tag}identical_rewrite_uploads": float(same_bytes),
        f"{tag}changed_rewrite_uploads": float(new_bytes),
    }


async def run(args: argparse.Namespace, root: Path) -> dict[str, float]:
    rng = random.Random(args.seed)
    results: dict[str, float] = {}
    for interval in args.interval or [2.0]:
        results.update(await measure(interval, args.samples, args.poll_ms / 1000, root, rng))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20,
                        help="files written and timed per interval (default: %(default)s)")
    parser.add_argument("--interval", type=float, action="append",
                        help="the agent's --file-sync-interval in seconds; repeat for "
                             "several runs (default: 2, the platform's default)")
    parser.add_argument("--poll-ms", type=float, default=20.0,
                        help="how often the files API is polled (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.poll_ms <= 0 or any(i <= 0 for i in args.interval or []):
        parser.error("need --samples >= 1, --poll-ms > 0 and --interval > 0")
    results = measured(BENCH, lambda tmp: run(args, tmp))
    if results is None:
        return 130
    for interval in args.interval or [2.0]:
        tag = f"i{interval:g}_"
        within = results[f"{tag}rpo_max_within_stated"] == 1.0
        print(f"{BENCH}: interval {interval:g} s | max {results[f'{tag}rpo_max_ms']:.0f} ms, "
              f"stated {results[f'{tag}rpo_stated_ms']:.0f} ms: "
              f"{'within' if within else 'NOT within'} | identical rewrites uploaded "
              f"{results[f'{tag}identical_rewrite_uploads']:.0f}/"
              f"{results[f'{tag}identical_rewrite_files']:.0f}, changed rewrites uploaded "
              f"{results[f'{tag}changed_rewrite_uploads']:.0f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
