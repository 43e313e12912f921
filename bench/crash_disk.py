"""Two costs a laptop and a host that crashes care about (run as root, sandboxed).

- **Disk used by idle running workspaces.** ``--workspaces`` (default 20) running
  workspaces, each with an idle kernel that wrote a 1 MiB file, under the default
  10 GiB disk quota each. Reported: the host disk the agent's state takes (blocks
  allocated), per workspace, and against the baseline the quotas would take if
  reserved up front, as they were (their sum of limits).
- **Restart after kill -9.** With ``--running`` (default 10) of them running,
  ``nbfleet up`` is killed with SIGKILL (the slots' mounts stay behind), started
  again on the same home, and timed: until ``/healthz`` answers, and until every
  one of those workspaces is running again and a cell in each sees its variable,
  restored from its last checkpoint.

    sudo .venv/bin/python bench/crash_disk.py
    sudo .venv/bin/python bench/crash_disk.py --workspaces 10 --running 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import websockets

from harness import (
    SERVER_PIDS,
    channels_url,
    healthy,
    measured,
    nbfleet_up,
    stderr,
    workspace_kernel,
)
from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "crash_disk"
DISK_LIMIT_BYTES = 10 << 30  # the default --workspace-disk


def _allocated(directory: Path) -> int:
    """Bytes of disk the files below ``directory`` take (not their apparent sizes)."""
    total = 0
    for root, dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(root, d))]
    return total


async def _cell(url: str, ws: str, kernel: str, token: str, code: str) -> str:
    sock = await KernelSocket.connect(channels_url(url, ws, kernel), token)
    try:
        result = await sock.execute(code, timeout=120)
    finally:
        await sock.close()
    if result.status != "ok":
        raise RuntimeError(f"cell failed in {ws}: {result.reply}")
    return result.stdout


def _start_again(home: Path, port: str, args: tuple[str, ...]) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_HOME"] = str(home)
    with open(home / "restart.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "nbfleet.cli.main", "up", "--port", port, *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


async def run(tmp: Path, workspaces: int, running: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    home = tmp / "home"
    home.mkdir()
    made: list[tuple[str, str, str]] = []
    args = ("--sandbox", "bwrap", "--warm-pool", "1")
    with nbfleet_up(home, *args) as url:
        before = _allocated(home / "agent")
        for index in range(workspaces):
            # Ten running workspaces per user is the default quota.
            sock, kernel, ws, token = await workspace_kernel(url, home, f"b{index}")
            await sock.close()
            await _cell(url, ws, kernel, token,
                        f"x = {index}\nopen('one.bin', 'wb').write(b'x' * (1 << 20))")
            made.append((ws, kernel, token))
        stderr.print(f"{workspaces} workspaces running, each with an idle kernel")
        used = _allocated(home / "agent") - before
        figures |= {"idle_workspaces": workspaces,
                    "disk_used_mib": used / (1 << 20),
                    "disk_per_workspace_mib": used / workspaces / (1 << 20),
                    "baseline_reserved_gib": workspaces * DISK_LIMIT_BYTES / (1 << 30),
                    "used_over_baseline": used / (workspaces * DISK_LIMIT_BYTES)}
        async with httpx.AsyncClient(base_url=url, timeout=90) as api:
            for ws, _, token in made[running:]:
                (await api.post(f"/v1/workspaces/{ws}/suspend", params={"wait": 60},
                                headers={"Authorization": f"Bearer {token}"})
                 ).raise_for_status()
        pid = SERVER_PIDS[url]
        os.kill(pid, signal.SIGKILL)
        stderr.print(f"killed nbfleet up ({pid}) with {running} workspaces running")
    started = time.monotonic()
    proc = _start_again(home, url.rsplit(":", 1)[1], args)
    try:
        while not healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"nbfleet up exited with {proc.returncode} on restart")
            await asyncio.sleep(0.05)
        figures["restart_to_healthy_s"] = time.monotonic() - started
        for index, (ws, kernel, token) in enumerate(made[:running]):
            while True:
                try:
                    if (await _cell(url, ws, kernel, token, "print(x)")).strip() == str(index):
                        break
                except (RuntimeError, OSError, httpx.HTTPError, TimeoutError,
                        websockets.exceptions.WebSocketException):
                    pass
                if time.monotonic() - started > 300:
                    raise TimeoutError(f"{ws} did not come back")
                await asyncio.sleep(0.2)
        figures["restart_to_all_running_s"] = time.monotonic() - started
        figures["running_at_kill"] = running
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspaces", type=int, default=20)
    parser.add_argument("--running", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: disk quotas (loop-mounted filesystems) need it")
    measured(BENCH, lambda tmp: run(tmp, args.workspaces, min(args.running,
                                                              args.workspaces)))


if __name__ == "__main__":
    main()
