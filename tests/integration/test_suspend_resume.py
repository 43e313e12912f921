"""Suspend and resume with files, packages and variables, through real processes.

Each cluster here is a real control plane, a real agent and real ipykernels in the
sandbox. The typical workspace of issue 4 is built cell by cell, suspended and
resumed, on the warm-pool path and on the cold path.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nbfleet.control.workspaces import WorkspaceBody
from nbfleet.sdk.kernel_socket import KernelSocket
from tests.conftest import running_cluster
from tests.support.cluster import (
    Cluster,
    create_running,
    outcome,
    resume,
    run_cell,
    start_kernel,
    suspend,
    token_of,
    wait_state,
    wait_until,
)
from tests.support.wheels import build_wheel

#: Cells that build the typical workspace (arrays smaller than the benchmark's 50 MB).
SETUP = [
    "%pip install --no-index --quiet ./nbf_demo-0.1-py3-none-any.whl",
    "!pip install --no-index --quiet ./nbf_bang-0.1-py3-none-any.whl",  # the shell form too
    "import numpy as np\nimport pandas as pd\nimport threading, socket\nimport nbf_demo, nbf_bang",
    "rng = np.random.default_rng(7)\narr = rng.random(1_000_000)",  # 8 MB
    "df = pd.DataFrame({'a': np.arange(200_000), 'b': rng.random(200_000),\n"
    "                   'c': [f's{i % 97}' for i in range(200_000)]})",
    "d = {'k': [1, 2, {'x': 3}]}\nitems = list(range(50))\nn, ratio, name = 7, 2.5, 'nb'",
    "def square(x):\n    return x * x",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
    "    def norm2(self):\n        return self.x ** 2 + self.y ** 2\np = Point(3, 4)",
    "arr[:10] += 1\nd['k'].append(4)",  # mutations after definition
    "fh = open('data.txt')\nfirst = fh.readline()",  # unpicklable, recomputable
    "lock = threading.Lock()",
    "log = []\nsock = socket.socket()\nlog.append('opened')",  # unpicklable, mutates log: lost
    "open('out.bin', 'wb').write(bytes(range(256)) * 1000)",
]

FINGERPRINT = (
    "import hashlib\n"
    "print(hashlib.sha256(arr.tobytes()).hexdigest(),"
    " hashlib.sha256(pd.util.hash_pandas_object(df).values.tobytes()).hexdigest(),"
    " repr((d, items, n, ratio, name, first, log)), square(12), p.norm2(),"
    " type(p).__name__, nbf_demo.VALUE, nbf_demo.__file__.split('/')[-3],"
    " nbf_bang.VALUE, nbf_bang.__file__.split('/')[-3])"
)


def agent_kernels(cluster: Cluster) -> list[dict[str, Any]]:
    agent = cluster.admin().get("/v1/admin/agents").json()["items"][0]
    secret = (cluster.home / "cluster-secret").read_text().strip()
    response = httpx.get(f"{agent['url']}/agent/v1/kernels",
                         headers={"Authorization": f"Bearer {secret}"})
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()
    return result


def iopub_on_attach(cluster: Cluster, client: httpx.Client, ws: str, kernel: str) -> str:
    """The text the agent left on the kernel's iopub stream for the next client."""

    async def read() -> str:
        sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
        text = ""
        try:
            while True:
                msg = await sock.receive(timeout=2.0)
                if msg.get("msg_type") == "stream":
                    text += msg["content"]["text"]
        except TimeoutError:
            return text
        finally:
            await sock.close()

    return asyncio.run(read())


def typical_workspace(cluster: Cluster, tmp_path: Path) -> tuple[httpx.Client, str, str]:
    client = cluster.new_user()
    ws = create_running(client)
    for name, value in (("nbf_demo", "demo-42"), ("nbf_bang", "bang-7")):
        wheel = build_wheel(tmp_path, name, "0.1", f"VALUE = {value!r}\n")
        assert client.put(f"/v1/workspaces/{ws}/files/{wheel.name}",
                          content=wheel.read_bytes()).status_code in (200, 201)
    assert client.put(f"/v1/workspaces/{ws}/files/data.txt",
                      content=b"line one\nline two\n").status_code in (200, 201)
    kernel = start_kernel(client, ws)
    for cell in SETUP:
        result = run_cell(cluster, client, ws, kernel, cell)
        assert result.status == "ok", (cell, result.reply, result.outputs)
    return client, ws, kernel


def check_round_trip(cluster: Cluster, tmp_path: Path, path: str) -> None:
    """Build, suspend and resume the typical workspace; ``path``: warm or cold."""
    client, ws, kernel = typical_workspace(cluster, tmp_path)
    before = outcome(run_cell(cluster, client, ws, kernel, FINGERPRINT))
    # Both imported from the workspace's layer, not the base environment.
    assert "demo-42 packages bang-7 packages" in before, before

    suspended = suspend(client, ws)
    assert suspended["state"] == "suspended" and suspended["host_id"] is None
    assert suspended["snapshot"]["bytes"] > 8_000_000 and suspended["snapshot"]["packages"]
    assert not [k for k in agent_kernels(cluster) if k["workspace_id"] == ws]
    files = {name: client.get(f"/v1/workspaces/{ws}/files/{name}").content
             for name in ("out.bin", "data.txt")}
    assert files["out.bin"] == bytes(range(256)) * 1000

    if path == "warm":
        wait_pool_full(cluster)  # its kernel became this workspace's first kernel
        hits = metric(agent_metrics(cluster), 'nbfleet_agent_warm_pool_claims_total{outcome="hit"}')
    body = resume(client, ws)
    if path == "warm":
        text = agent_metrics(cluster)
        assert metric(text, 'nbfleet_agent_warm_pool_claims_total{outcome="hit"}') == hits + 1
        assert metric(text, "nbfleet_agent_warm_pool_target") == 1.0
        assert 0 < metric(text, "nbfleet_agent_warm_pool_hit_ratio") <= 1
    report = body["restore"]["kernels"][kernel]
    assert report["path"] == path and not report["files_only"]
    assert {"arr", "df", "d", "items", "n", "ratio", "name", "square", "Point", "p",
            "first", "log"} <= set(report["restored"])
    assert sorted(report["recomputed"]) == ["fh", "lock"]
    assert [(lost["name"], lost["type"]) for lost in report["lost"]] == [
        ("sock", "socket.socket")]
    assert body["restore"]["packages"] == {"restored": True}
    told = iopub_on_attach(cluster, client, ws, kernel)
    assert "[nbfleet] Resumed: restored" in told and "recomputed fh, lock" in told
    assert "Not restored: sock (socket.socket)" in told

    after = outcome(run_cell(cluster, client, ws, kernel, FINGERPRINT))
    assert after == before  # every value equal, the function, the class and the package work
    checks = outcome(run_cell(cluster, client, ws, kernel, (
        "print(fh.readline().strip(), lock.acquire(blocking=False), 'sock' in globals(),"
        " Point(1, 1).norm2(), hashlib.sha256(open('out.bin','rb').read()).hexdigest())")))
    digest = hashlib.sha256(files["out.bin"]).hexdigest()
    assert checks == f"line two True False 2 {digest}\n"  # recomputed: the file is re-read
    for name, data in files.items():  # the files are byte-identical after the round trip
        assert client.get(f"/v1/workspaces/{ws}/files/{name}").content == data


# ------------------------------------------------------------------ warm cluster
@pytest.fixture(scope="module")
def warm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("warm"), warm_pool=1) as cluster:
        yield cluster


def agent_metrics(cluster: Cluster) -> str:
    agent = cluster.admin().get("/v1/admin/agents").json()["items"][0]
    secret = (cluster.home / "cluster-secret").read_text().strip()
    return httpx.get(f"{agent['url']}/agent/v1/metrics",
                     headers={"Authorization": f"Bearer {secret}"}).text


def metric(text: str, name: str) -> float:
    """A sample's value; 0 for a labelled counter that has not counted yet."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ")]
    assert len(values) <= 1, (name, values)
    return values[0] if values else 0.0


def wait_pool_full(cluster: Cluster) -> None:
    wait_until(lambda: metric(agent_metrics(cluster), "nbfleet_agent_warm_pool_size") == 1.0,
               90, 0.2, "a full warm pool")


def test_typical_workspace_round_trip_from_the_warm_pool(warm_cluster: Cluster,
                                                         tmp_path: Path) -> None:
    check_round_trip(warm_cluster, tmp_path, "warm")


def test_resume_requested_twice_gives_one_runtime(warm_cluster: Cluster) -> None:
    client = warm_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    assert outcome(run_cell(warm_cluster, client, ws, kernel, "x = 41")) == ""
    suspend(client, ws)
    statuses: list[int] = []

    def ask(key: str) -> None:
        response = client.post(f"/v1/workspaces/{ws}/resume", params={"wait": 120},
                               headers={"Idempotency-Key": key})
        statuses.append(response.status_code)

    threads = [threading.Thread(target=ask, args=(f"k{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * 4
    mine = [k for k in agent_kernels(warm_cluster) if k["workspace_id"] == ws]
    assert [k["id"] for k in mine] == [kernel]
    assert outcome(run_cell(warm_cluster, client, ws, kernel, "print(x + 1)")) == "42\n"


# ------------------------------------------------------------------ cold cluster
@pytest.fixture(scope="module")
def cold_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # No warm kernel anywhere: the agent's pool is off, and so is the GPU scheduler's.
    args = ("--suspend-busy-timeout", "2", "--cull-interval", "0.5", "--idle-suspend", "0",
            "--prewarm", "0")
    with running_cluster(tmp_path_factory.mktemp("cold"), control_args=args) as cluster:
        yield cluster


def test_typical_workspace_round_trip_cold(cold_cluster: Cluster, tmp_path: Path) -> None:
    check_round_trip(cold_cluster, tmp_path, "cold")


def snapshot_keys(cluster: Cluster, ws: str) -> list[Path]:
    return sorted((cluster.home / "blobs" / "workspaces" / ws / "snapshots").rglob("*.json"))


def test_a_corrupt_snapshot_resumes_with_files_only(cold_cluster: Cluster) -> None:
    client = cold_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    run_cell(cold_cluster, client, ws, kernel, "big = bytes(200_000)\nopen('f.txt','w').write('f')")
    suspend(client, ws)
    for manifest in snapshot_keys(cold_cluster, ws):
        manifest.write_bytes(b'{"format": 1, "blobs": ["' + b"0" * 64 + b'"]}')

    report = resume(client, ws)["restore"]["kernels"][kernel]
    assert report["files_only"] and "corrupt snapshot" in report["error"]
    assert "files only" in iopub_on_attach(cold_cluster, client, ws, kernel)
    assert outcome(run_cell(cold_cluster, client, ws, kernel,
                            "print('big' in globals(), open('f.txt').read())")) == "False f\n"


def test_a_failing_blob_store_keeps_the_workspace_running(cold_cluster: Cluster) -> None:
    client = cold_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    run_cell(cold_cluster, client, ws, kernel, "big = bytes(range(256)) * 1000")
    # A file where the store's content directory should be: every blob write fails.
    blocker = cold_cluster.home / "blobs" / "workspaces" / ws / "cas"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"not a directory")

    body = suspend(client, ws)
    assert body["state"] == "running" and "could not save" in body["last_error"]
    assert body["desired_state"] == "running"
    # Nothing saved. The cell's checkpoint may have failed on the same store, and
    # then says so (the suspend's error stays the last one).
    snapshot = body["snapshot"]
    assert snapshot is None or (snapshot["at"] is None and snapshot["kernels"] == []
                                and set(snapshot["checkpoint_failures"]) == {kernel}), snapshot
    assert outcome(run_cell(cold_cluster, client, ws, kernel, "print(len(big))")) == "256000\n"

    blocker.unlink()
    assert suspend(client, ws)["state"] == "suspended"
    resume(client, ws)
    assert outcome(run_cell(cold_cluster, client, ws, kernel, "print(len(big))")) == "256000\n"


def test_suspend_waits_for_a_short_cell_and_interrupts_a_long_one(cold_cluster: Cluster) -> None:
    client = cold_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)

    async def start_cell(code: str) -> None:
        sock = await KernelSocket.connect(cold_cluster.channels_url(ws, kernel), token_of(client))
        await sock.send(sock.message("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}, "shell"))
        await asyncio.sleep(0.5)  # the cell is running when the socket goes away
        await sock.close()

    asyncio.run(start_cell("import time\ntime.sleep(1.5)\ny = 5"))
    body = suspend(client, ws)  # waits up to 2 s: the cell finishes first
    assert body["state"] == "suspended" and body["snapshot"]["notes"] == []
    resume(client, ws)
    assert outcome(run_cell(cold_cluster, client, ws, kernel, "print(y)")) == "5\n"

    asyncio.run(start_cell("z = 1\nwhile True:\n    time.sleep(0.1)"))
    body = suspend(client, ws)  # still running after 2 s: interrupted, then suspended
    assert body["state"] == "suspended"
    assert body["snapshot"]["notes"] == ["a running cell was interrupted to suspend"]
    resume(client, ws)
    assert outcome(run_cell(cold_cluster, client, ws, kernel, "print(y, z)")) == "5 1\n"


def test_idle_workspaces_are_suspended_and_busy_ones_never(cold_cluster: Cluster) -> None:
    admin = cold_cluster.admin()
    org, project = "idle-org", "fast-cull"
    idle_client = cold_cluster.new_user(org=org, project=project)
    busy_client = cold_cluster.new_user(org=org, project=project)
    other = cold_cluster.new_user(org=org, project="default-timeout")
    idle_ws, busy_ws, other_ws = (create_running(c) for c in (idle_client, busy_client, other))
    idle_kernel = start_kernel(idle_client, idle_ws)
    busy_kernel = start_kernel(busy_client, busy_ws)
    run_cell(cold_cluster, idle_client, idle_ws, idle_kernel, "a = 1")

    async def silent_busy() -> None:
        sock = await KernelSocket.connect(cold_cluster.channels_url(busy_ws, busy_kernel),
                                          token_of(busy_client))
        await sock.send(sock.message("execute_request", {
            "code": "import time\ntime.sleep(60)", "silent": False, "store_history": True,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}, "shell"))
        await asyncio.sleep(0.5)
        await sock.close()

    asyncio.run(silent_busy())
    response = admin.put(f"/v1/admin/orgs/{org}/projects/{project}/settings",
                         json={"idle_suspend_s": 3})
    assert response.status_code == 200, response.text

    wait_state(idle_client, idle_ws, "suspended", timeout=30)
    time.sleep(2)  # several more passes: the busy kernel is silent for longer than 3 s
    # The busy kernel has printed nothing for longer than the timeout, and stays.
    assert busy_client.get(f"/v1/workspaces/{busy_ws}").json()["state"] == "running"
    assert other.get(f"/v1/workspaces/{other_ws}").json()["state"] == "running"
    resume(idle_client, idle_ws)
    assert outcome(run_cell(cold_cluster, idle_client, idle_ws, idle_kernel, "print(a)")) == "1\n"


def test_project_settings_refuse_bad_input_and_unknown_projects(cold_cluster: Cluster) -> None:
    admin = cold_cluster.admin()
    cold_cluster.new_user(org="cfg-org", project="p")
    bad = admin.put("/v1/admin/orgs/cfg-org/projects/p/settings", json={"idle_suspend_s": -1})
    assert bad.status_code == 422
    assert bad.headers["content-type"].startswith("application/problem+json")
    missing = admin.put("/v1/admin/orgs/cfg-org/projects/nope/settings",
                        json={"idle_suspend_s": 5})
    assert missing.status_code == 404
    user = cold_cluster.new_user(org="cfg-org", project="p")
    assert user.put("/v1/admin/orgs/cfg-org/projects/p/settings",
                    json={"idle_suspend_s": 5}).status_code == 404


# --------------------------------------------------------- kill -9 mid-suspend
def test_agent_killed_mid_suspend_keeps_the_last_complete_snapshot(tmp_path: Path) -> None:
    """Without cell checkpoints (which would have saved ``x = 'second'`` already:
    ``test_failover``), the state is the last suspend's."""
    slow = {"NBFLEET_FAULT_RELEASE_DELAY_S": "4"}
    suspends_only = ("--no-cell-checkpoints",)
    with running_cluster(tmp_path, agent_env=slow, agent_args=suspends_only) as cluster:
        client = cluster.new_user()
        ws = create_running(client)
        kernel = start_kernel(client, ws)
        run_cell(cluster, client, ws, kernel, "x = 'first'\nopen('f.txt','w').write('v1')")
        suspend(client, ws)  # the last complete snapshot: x == 'first'
        resume(client, ws)
        run_cell(cluster, client, ws, kernel, "x = 'second'\nopen('f.txt','w').write('v2')")

        client.post(f"/v1/workspaces/{ws}/suspend")
        wait_until(lambda: snapshot_count(cluster, ws) == 2, 60, 0.05, "the second upload")
        cluster.kill_agent()  # uploaded, not yet recorded: mid-suspend

        body = wait_state(client, ws, "suspended", timeout=60)
        assert len(body["snapshot"]["kernels"]) == 1
        cluster.start_agent(env=slow, args=suspends_only)
        resume(client, ws)
        assert outcome(run_cell(cluster, client, ws, kernel, "print(x)")) == "first\n"


def snapshot_count(cluster: Cluster, ws: str) -> int:
    return len(snapshot_keys(cluster, ws))


# ------------------------------------------------- replays never repeat side effects
def test_a_cell_that_writes_files_is_not_rerun_by_three_resumes(cold_cluster: Cluster) -> None:
    """Issue 13: a line appended once appeared 4 times after 3 suspend/resume cycles."""
    client = cold_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    cell = "import threading\nopen('run.log', 'a').write('started\\n')\nlock = threading.Lock()"
    assert run_cell(cold_cluster, client, ws, kernel, cell).status == "ok"
    for cycle in range(3):
        suspend(client, ws)
        body = resume(client, ws)
        report = body["restore"]["kernels"][kernel]
        assert body["restore"]["generation"] == body["generation"]
        assert [(lost["name"], lost["type"]) for lost in report["lost"]] == [
            ("lock", "_thread.lock")], (cycle, report)
        assert "writes files (open(..., 'a')), so it is not re-run on resume" in (
            report["lost"][0]["reason"])
        assert outcome(run_cell(cold_cluster, client, ws, kernel,
                                "print(repr(open('run.log').read()), 'lock' in globals())")
                       ) == "'started\\n' False\n", cycle
    assert client.get(f"/v1/workspaces/{ws}/files/run.log").content == b"started\n"


def test_a_value_that_comes_back_changed_is_reported_changed_over_the_api(
        cold_cluster: Cluster) -> None:
    """The kernel's ``changed`` and ``settings`` reach the API (as the schema says)
    and the notebook; a changed value is neither restored nor lost."""
    client = cold_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    drifts = ("class Drifts:\n    def __init__(self):\n        self.n = 1\n"
              "    def __setstate__(self, state):\n"
              "        self.__dict__.update(state)\n        self.n += 1\n"
              "d = Drifts()\nsame = [1, 2]")
    assert run_cell(cold_cluster, client, ws, kernel, drifts).status == "ok"
    suspend(client, ws)
    body = resume(client, ws)
    WorkspaceBody.model_validate(body)
    report = body["restore"]["kernels"][kernel]
    [changed] = report["changed"]
    assert (changed["name"], changed["type"]) == ("d", "__main__.Drifts"), report
    assert changed["reason"].startswith("it came back different from the value saved")
    assert "same" in report["restored"] and "d" not in report["restored"]
    assert report["lost"] == []
    assert {"name": "execution count", "status": "restored"} in report["settings"], report
    told = iopub_on_attach(cold_cluster, client, ws, kernel)
    assert "1 came back changed" in told and "[nbfleet] Changed: d (__main__.Drifts): " in told
    assert outcome(run_cell(cold_cluster, client, ws, kernel, "print(d.n, same)")) == "2 [1, 2]\n"


def test_a_replay_that_would_sleep_a_minute_does_not_hold_up_the_resume(
        cold_cluster: Cluster) -> None:
    client = cold_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    for cell in ("delay = 0", "import time, threading\ntime.sleep(delay)\nlock = threading.Lock()",
                 "delay = 60"):  # a replay reads today's delay: it would sleep a minute
        assert run_cell(cold_cluster, client, ws, kernel, cell).status == "ok"
    suspend(client, ws)
    started = time.monotonic()
    body = resume(client, ws)
    assert time.monotonic() - started < 45  # the 10 s replay budget, then on
    [lost] = body["restore"]["kernels"][kernel]["lost"]
    assert lost["name"] == "lock"
    assert lost["reason"] == ("re-running the cell that made it took longer than 10 s, "
                              "so it was stopped")
    assert outcome(run_cell(cold_cluster, client, ws, kernel, "print(delay)")) == "60\n"
