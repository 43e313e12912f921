"""Issue 16: kernels as a standard ipykernel starts them, resumes into a kernel that
already imported the workspace's modules, and a burst of concurrent resumes.

Real control plane, agent and sandboxed kernels. Behaviour only, never timings: the
latencies are ``bench/resume.py``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import running_cluster
from tests.integration.test_suspend_resume import (
    agent_kernels,
    agent_metrics,
    metric,
    resume,
    suspend,
)
from tests.support.cluster import (
    Cluster,
    create_running,
    outcome,
    run_cell,
    start_kernel,
    wait_until,
)

#: What a kernel knows about how it was started, and what it has imported.
PROBE = ("import os, sys\n"
         "print(os.environ.get('NBFLEET_PREIMPORT'), 'matplotlib.pyplot' in sys.modules)")


@pytest.fixture(scope="module")
def warm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("speed"), warm_pool=1) as cluster:
        yield cluster


def pool(cluster: Cluster) -> dict[str, float]:
    text = agent_metrics(cluster)
    return {name: metric(text, f"nbfleet_agent_warm_pool_{name}")
            for name in ("size", "prepared", "profiles")}


def wait_pool(cluster: Cluster, plain: int, prepared: int) -> None:
    def ready() -> bool:
        now = pool(cluster)
        return now["size"] - now["prepared"] == plain and now["prepared"] == prepared

    wait_until(ready, 120, 0.2, f"a warm pool of {plain} plain and {prepared} prepared")


def workspace(cluster: Cluster, cells: list[str]) -> tuple[httpx.Client, str, str]:
    client = cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    for cell in cells:
        result = run_cell(cluster, client, ws, kernel, cell)
        assert result.status == "ok", (cell, result.reply)
    return client, ws, kernel


def test_a_plot_in_a_headless_kernel_shows_as_a_png(warm_cluster: Cluster) -> None:
    """No MPLBACKEND is forced on kernels: ipykernel picks the inline backend."""
    client, ws, kernel = workspace(warm_cluster, [])
    result = run_cell(warm_cluster, client, ws, kernel,
                      "import os\nimport matplotlib.pyplot as plt\n"
                      "plt.plot([1, 3, 2])\nplt.show()\n"
                      "print(plt.get_backend(), os.environ.get('MPLBACKEND'))")
    assert result.status == "ok", result.reply
    [png] = result.data("image/png")
    assert len(png) > 1000  # base64 of a real figure
    assert "inline" in result.stdout.lower(), result.stdout


def test_a_workspace_resumes_into_a_kernel_prepared_with_its_imports(
        warm_cluster: Cluster) -> None:
    mpl = ["import matplotlib.pyplot as plt\nfrom matplotlib import colors",
           "fig, ax = plt.subplots()\nline, = ax.plot([1, 2, 3])\nnorm = colors.Normalize(0, 4)"]
    client, ws, kernel = workspace(warm_cluster, mpl)
    light_client, light_ws, light_kernel = workspace(warm_cluster, ["import numpy as np",
                                                                    "a = np.arange(5)"])
    wait_pool(warm_cluster, plain=1, prepared=0)
    suspend(light_client, light_ws)
    suspend(client, ws)  # its resume is likely: the pool prepares a kernel for it
    wait_pool(warm_cluster, plain=1, prepared=1)
    claims = metric(agent_metrics(warm_cluster),
                    "nbfleet_agent_warm_pool_prepared_claims_total")

    # A workspace that never imported matplotlib gets the plain kernel, not that one.
    report = resume(light_client, light_ws)["restore"]["kernels"][light_kernel]
    assert report["path"] == "warm" and "prepared" not in report
    assert outcome(run_cell(warm_cluster, light_client, light_ws, light_kernel,
                            PROBE + "\nprint(a.sum())")) == "numpy,pandas False\n10\n"
    wait_pool(warm_cluster, plain=1, prepared=1)

    report = resume(client, ws)["restore"]["kernels"][kernel]
    assert report["path"] == "warm" and not report["files_only"]
    assert {"matplotlib.pyplot", "matplotlib.colors", "matplotlib.figure"} <= set(
        report["prepared"]), report
    assert {"fig", "ax", "line", "norm"} <= set(report["restored"])
    started_with = outcome(run_cell(warm_cluster, client, ws, kernel, PROBE))
    modules = started_with.split()[0].split(",")
    assert modules[:2] == ["numpy", "pandas"] and "matplotlib.pyplot" in modules
    assert outcome(run_cell(warm_cluster, client, ws, kernel,
                            "print(len(ax.lines), norm(2))")) == "1 0.5\n"
    assert metric(agent_metrics(warm_cluster),
                  "nbfleet_agent_warm_pool_prepared_claims_total") == claims + 1
    wait_pool(warm_cluster, plain=1, prepared=0)  # claimed: not prepared again


def test_what_the_warm_kernel_lacks_is_imported_while_the_state_downloads(
        warm_cluster: Cluster) -> None:
    """Standard-library modules are never worth a prepared kernel; the claimed
    kernel imports them before the restore needs them."""
    client, ws, kernel = workspace(warm_cluster, [
        "import fractions\nfrom xml.dom import minidom",
        "half = fractions.Fraction(1, 2)\n"
        "tag = minidom.parseString('<a>1</a>').firstChild.tagName"])
    wait_pool(warm_cluster, plain=1, prepared=0)
    suspend(client, ws)
    assert pool(warm_cluster)["profiles"] == 0
    report = resume(client, ws)["restore"]["kernels"][kernel]
    assert report["path"] == "warm" and "prepared" not in report
    assert {"fractions", "xml.dom", "xml.dom.minidom"} <= set(report["preimported"]), report
    assert outcome(run_cell(warm_cluster, client, ws, kernel,
                            "print(half * 3, tag)")) == "3/2 a\n"


# ------------------------------------------------------------------- the burst
@pytest.fixture(scope="module")
def burst_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("burst"), warm_pool=2) as cluster:
        yield cluster


def test_a_burst_of_resumes_gives_every_workspace_its_own_state(
        burst_cluster: Cluster) -> None:
    count = 6
    built = [workspace(burst_cluster, [f"ident = 'ws-{i}'\nvalues = list(range({i}))"])
             for i in range(count)]
    for client, ws, _ in built:
        suspend(client, ws)
    wait_pool(burst_cluster, plain=2, prepared=0)
    answers: dict[str, dict[str, Any]] = {}

    def ask(client: httpx.Client, ws: str) -> None:
        answers[ws] = resume(client, ws)

    threads = [threading.Thread(target=ask, args=(client, ws)) for client, ws, _ in built]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == count  # every one answered 200, running
    paths = [answers[ws]["restore"]["kernels"][kernel]["path"] for _, ws, kernel in built]
    assert set(paths) <= {"warm", "cold"} and "warm" in paths
    on_agent = {k["id"]: k["workspace_id"] for k in agent_kernels(burst_cluster)}
    for index, (client, ws, kernel) in enumerate(built):
        assert on_agent[kernel] == ws  # one kernel each, its own
        assert outcome(run_cell(burst_cluster, client, ws, kernel,
                                "print(ident, sum(values))")) == (
            f"ws-{index} {sum(range(index))}\n")


@pytest.mark.no_db
def test_kernels_start_without_a_forced_matplotlib_backend(tmp_path: Path) -> None:
    from nbfleet.agent.slots import kernel_env

    assert "MPLBACKEND" not in kernel_env(str(tmp_path))
