"""Resume of a notebook with heavy imports, and a burst of concurrent resumes (issue 16).

Used by ``bench/resume.py``:

1. The heavy-import notebook: matplotlib, SciPy and scikit-learn (and SymPy where
   installed), with a fitted model, a frozen distribution, a figure and a symbolic
   expression. Resumed *prepared* (``--warm-pool 1``: after its suspend the pool
   starts a kernel with the notebook's imports), and as baselines in the same run,
   *unprepared* (``--warm-profiles 0``: a plain warm kernel, which imports them
   while the snapshot downloads) and *cold* (``--warm-pool 0``).
2. The burst: ``--burst`` light workspaces (numpy and pandas, a small array and
   DataFrame, an id of their own) suspended, then all resumed at once on one agent
   with a warm kernel ready for each (``--warm-pool`` = the burst); before it, the
   same workspaces resumed one at a time, the baseline. Each workspace is checked
   to hold its own state afterwards.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from harness import admin_headers, channels_url, nbfleet_up, p95, stderr, workspace_kernel
from nbfleet.sdk.kernel_socket import KernelSocket

WAIT_S = 120
HEAVY_NEEDS = ("matplotlib", "scipy", "sklearn")
HEAVY = [
    "import matplotlib.pyplot as plt\nimport numpy as np\nfrom scipy import stats\n"
    "from sklearn.datasets import make_classification\n"
    "from sklearn.linear_model import LogisticRegression\n"
    "from sklearn.ensemble import RandomForestClassifier",
    "X, y = make_classification(n_samples=500, n_features=8, random_state=0)\n"
    "clf = LogisticRegression(max_iter=500).fit(X, y)\n"
    "forest = RandomForestClassifier(n_estimators=20, random_state=0).fit(X, y)",
    "dist = stats.norm(1.0, 2.0)\nfig, ax = plt.subplots()\nax.plot([1, 2, 3], [3, 1, 2])",
]
SYMPY = "import sympy as sp\nx = sp.symbols('x')\nexpr = sp.expand((x + 1) ** 5)"
HEAVY_CHECK = ("print(round(clf.score(X, y), 4), round(forest.score(X, y), 4), dist.mean(),"
               " len(ax.lines), str(globals().get('expr')))")
LIGHT = ["import numpy as np\nimport pandas as pd",
         "arr = np.arange(200_000) * {index}\n"
         "df = pd.DataFrame({{'a': np.arange(5_000), 'b': np.arange(5_000) % 7}})\n"
         "ident = '{index}'"]
LIGHT_CHECK = "print(ident, int(arr.sum()), int(df['b'].sum()))"


def heavy_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in HEAVY_NEEDS)


async def run_cell(sock: KernelSocket, code: str, timeout: float = 300.0) -> str:
    result = await sock.execute(code, timeout=timeout)
    if result.status != "ok":
        raise RuntimeError(f"cell failed: {code[:60]!r}: {result.reply}")
    return str(result.stdout)


async def timed(http: httpx.AsyncClient, path: str) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = await http.post(path, params={"wait": WAIT_S})
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{path}: {response.status_code} {response.text[:300]}")
    body: dict[str, Any] = response.json()
    return elapsed, body


async def pool_state(http: httpx.AsyncClient, home: Path) -> dict[str, float]:
    """The embedded agent's warm-pool gauges (size, target, prepared, profiles)."""
    secret = {"Authorization": f"Bearer {(home / 'cluster-secret').read_text().strip()}"}
    agents = (await http.get("/v1/admin/agents", headers=admin_headers(home))).json()
    text = (await http.get(f"{agents['items'][0]['url']}/agent/v1/metrics",
                           headers=secret)).text
    out = {}
    for line in text.splitlines():
        if line.startswith("nbfleet_agent_warm_pool_"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("nbfleet_agent_warm_pool_")] = float(value)
    return out


async def pool_ready(http: httpx.AsyncClient, home: Path, prepared: bool) -> None:
    """Until the plain kernels are all ready (and, with ``prepared``, a prepared
    kernel for each import set the pool was asked for)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        gauges = await pool_state(http, home)
        ready = gauges.get("prepared", 0.0)  # absent before issue 16: none
        plain = gauges["size"] - ready
        if plain >= gauges["target"] and (not prepared
                                          or ready >= gauges.get("profiles", 0.0)):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("the warm pool did not refill")


HEAVY_PLATFORMS = {
    # A kernel prepared with the notebook's imports after its suspend.
    "prepared": ("--warm-pool", "1"),
    # A plain warm kernel (numpy, pandas), which imports the rest while the snapshot
    # downloads: no prepared kernels.
    "unprepared": ("--warm-pool", "1", "--warm-profiles", "0"),
    # No warm kernel at all (nor one from the GPU scheduler's prewarm).
    "cold": ("--warm-pool", "0", "--prewarm", "0"),
}


async def heavy_cycles(kind: str, count: int, root: Path) -> dict[str, float]:
    """The heavy-import notebook suspended and resumed ``count`` times on a platform
    of ``kind`` (HEAVY_PLATFORMS), its state checked after each resume."""
    home = root / f"heavy-{kind}"
    home.mkdir()
    with nbfleet_up(home, *HEAVY_PLATFORMS[kind], "--idle-suspend", "0") as url:
        sock, kernel, workspace, token = await workspace_kernel(url, home, "heavy")
        cells = HEAVY + ([SYMPY] if importlib.util.find_spec("sympy") else [])
        for cell in cells:
            await run_cell(sock, cell)
        expected = await run_cell(sock, HEAVY_CHECK)
        await sock.close()
        ws_url = channels_url(url, workspace, kernel)
        times: list[float] = []
        matches = 0
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S + 30,
                                     headers={"Authorization": f"Bearer {token}"}) as http:
            for _ in range(count):
                await timed(http, f"/v1/workspaces/{workspace}/suspend")
                if kind != "cold":
                    await pool_ready(http, home, prepared=kind == "prepared")
                took, body = await timed(http, f"/v1/workspaces/{workspace}/resume")
                report = body["restore"]["kernels"][kernel]
                times.append(took)
                path = "warm" if kind != "cold" else "cold"
                matches += report["path"] == path and (
                    bool(report.get("prepared")) == (kind == "prepared"))
                sock = await KernelSocket.connect(ws_url, token)
                got = await run_cell(sock, HEAVY_CHECK)
                await sock.close()
                if got != expected:
                    raise RuntimeError(f"state changed: {expected!r} -> {got!r}")
    ms = 1000.0
    return {f"heavy_{kind}_resume_p50_ms": statistics.median(times) * ms,
            f"heavy_{kind}_resume_p95_ms": p95(times) * ms,
            f"heavy_{kind}_path_matches": float(matches)}


async def burst(size: int, alone: int, root: Path) -> dict[str, float]:
    """``size`` light workspaces resumed one at a time (``alone`` rounds), then all at once."""
    home = root / "burst"
    home.mkdir()
    # Each workspace's disk quota is preallocated on the host: 64 slots of the default
    # 10 GiB would not fit on a bench machine's disk.
    with nbfleet_up(home, "--warm-pool", str(size), "--idle-suspend", "0",
                    "--workspace-disk", "256MiB") as url:
        gate = asyncio.Semaphore(4)

        async def build(index: int) -> tuple[str, str, str, str]:
            async with gate:
                sock, kernel, workspace, token = await workspace_kernel(url, home,
                                                                        f"burst{index}")
                for cell in LIGHT:
                    await run_cell(sock, cell.format(index=index))
                expected = await run_cell(sock, LIGHT_CHECK)
                await sock.close()
                return workspace, kernel, token, expected

        built = await asyncio.gather(*(build(i) for i in range(size)))
        clients = [httpx.AsyncClient(base_url=url, timeout=WAIT_S + 30,
                                     headers={"Authorization": f"Bearer {token}"})
                   for _, _, token, _ in built]
        try:
            async def cycle(index: int) -> tuple[float, str, float]:
                workspace, kernel = built[index][0], built[index][1]
                took, body = await timed(clients[index], f"/v1/workspaces/{workspace}/resume")
                report = body["restore"]["kernels"][kernel]
                return took, str(report["path"]), float(report.get("seconds", 0.0))

            async def suspend_all() -> None:
                await asyncio.gather(*(timed(clients[i], f"/v1/workspaces/{ws}/suspend")
                                       for i, (ws, _, _, _) in enumerate(built)))
                await pool_ready(clients[0], home, prepared=False)

            lone: list[float] = []
            await suspend_all()
            for index in range(min(alone, size)):  # the others stay suspended
                took, _, _ = await cycle(index)
                lone.append(took)
                await pool_ready(clients[0], home, prepared=False)
            await suspend_all()
            stderr.print(f"burst: resuming {size} workspaces at once")
            results = await asyncio.gather(*(cycle(i) for i in range(size)))
            for workspace, kernel, token, expected in built:
                ws_url = channels_url(url, workspace, kernel)
                sock = await KernelSocket.connect(ws_url, token)
                got = await run_cell(sock, LIGHT_CHECK)
                await sock.close()
                if got != expected:
                    raise RuntimeError(f"{workspace} came back with {got!r}, not {expected!r}")
        finally:
            await asyncio.gather(*(client.aclose() for client in clients))
    resumes = [t for t, _, _ in results]
    warm = [t for t, path, _ in results if path == "warm"]
    # The agent's share: downloading the snapshot and loading it in the kernel.
    restoring = [seconds for _, _, seconds in results]
    ms = 1000.0
    return {
        "light_alone_resume_p50_ms": statistics.median(lone) * ms,
        "light_alone_resume_max_ms": max(lone) * ms,
        f"burst{size}_resume_p50_ms": statistics.median(resumes) * ms,
        f"burst{size}_resume_p95_ms": p95(resumes) * ms,
        f"burst{size}_resume_max_ms": max(resumes) * ms,
        f"burst{size}_restore_p50_ms": statistics.median(restoring) * ms,
        f"burst{size}_restore_max_ms": max(restoring) * ms,
        f"burst{size}_warm_paths": float(len(warm)),
        f"burst{size}_states_checked": float(size),
        # Without two warm resumes there is no warm p95: never a 0 that "meets" it.
        **({f"burst{size}_warm_resume_p95_ms": p95(warm) * ms} if len(warm) > 1 else {}),
    }
