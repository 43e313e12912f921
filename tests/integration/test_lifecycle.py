"""Workspace lifecycle through the public API, on real processes."""

from __future__ import annotations

import httpx
import nbformat

from tests.support.cluster import (
    Cluster,
    create_running,
    events_of,
    outcome,
    run_cell,
    start_kernel,
    wait_state,
)


def notebook_bytes() -> bytes:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1")]
    return nbformat.writes(nb).encode()


def test_create_suspend_resume_delete_keeps_files(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client, "lifecycle")
    assert client.put(f"/v1/workspaces/{ws}/files/nb/demo.ipynb",
                      content=notebook_bytes()).status_code == 200
    csv = client.put(f"/v1/workspaces/{ws}/files/data.csv", content=b"a,b\n1,2\n")
    assert csv.status_code == 200

    suspended = client.post(f"/v1/workspaces/{ws}/suspend")
    assert suspended.status_code == 202
    assert suspended.json()["desired_state"] == "suspended"
    body = wait_state(client, ws, "suspended")
    assert body["host_id"] is None

    listed = {f["path"] for f in client.get(f"/v1/workspaces/{ws}/files").json()["files"]}
    assert listed == {"nb/demo.ipynb", "data.csv"}

    assert client.post(f"/v1/workspaces/{ws}/resume").status_code == 202
    wait_state(client, ws, "running")
    assert client.get(f"/v1/workspaces/{ws}/files/data.csv").content == b"a,b\n1,2\n"
    assert nbformat.reads(client.get(f"/v1/workspaces/{ws}/files/nb/demo.ipynb").text, 4)

    assert events_of(client, ws) == [
        (None, "creating"), ("creating", "running"), ("running", "suspending"),
        ("suspending", "suspended"), ("suspended", "resuming"), ("resuming", "running"),
    ]

    assert client.delete(f"/v1/workspaces/{ws}").status_code == 202
    wait_state(client, ws, "deleted")
    assert client.get(f"/v1/workspaces/{ws}/files").json()["files"] == []
    assert ws not in [w["id"] for w in client.get("/v1/workspaces").json()["items"]]


def test_illegal_transition_is_409_naming_the_state(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client)
    client.delete(f"/v1/workspaces/{ws}")
    wait_state(client, ws, "deleted")
    for verb in ("resume", "suspend"):
        response = client.post(f"/v1/workspaces/{ws}/{verb}")
        assert response.status_code == 409
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["current_state"] == "deleted"
        assert "deleted" in problem["detail"]
    put = client.put(f"/v1/workspaces/{ws}/files/a.txt", content=b"x")
    assert put.status_code == 409 and put.json()["current_state"] == "deleted"


def test_duplicate_suspend_requests_are_harmless(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client)
    generations = [client.post(f"/v1/workspaces/{ws}/suspend").json()["generation"]
                   for _ in range(5)]
    assert len(set(generations)) == 1  # only the first one changed the desired state
    wait_state(client, ws, "suspended")
    assert [to for _, to in events_of(client, ws)].count("suspended") == 1


def test_flip_flopping_requests_converge(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client)
    for verb in ("suspend", "resume", "suspend", "resume", "suspend", "resume"):
        assert client.post(f"/v1/workspaces/{ws}/{verb}").status_code == 202
    body = wait_state(client, ws, "running")
    assert body["desired_state"] == "running"


def test_resume_starts_new_kernel_processes_with_the_same_ids_and_state(
        shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)

    def run(code: str) -> str:
        return outcome(run_cell(shared_cluster, client, ws, kernel, code))

    # A process's start time tells processes apart; its pid does not in a PID
    # namespace, where every kernel is the same small number.
    started = "open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]"
    birth = run(f"open('made-by-kernel.txt', 'w').write('hi'); v = 5; print({started})")
    client.post(f"/v1/workspaces/{ws}/suspend")
    wait_state(client, ws, "suspended")
    # The kernel's own file was synced back to the blob store on suspend.
    assert client.get(f"/v1/workspaces/{ws}/files/made-by-kernel.txt").content == b"hi"
    # No process now, but the kernel keeps its id (it rests).
    resting = client.get(f"/v1/workspaces/{ws}/api/kernels").json()
    assert [(k["id"], k["execution_state"]) for k in resting] == [(kernel, "suspended")]
    client.post(f"/v1/workspaces/{ws}/resume")
    wait_state(client, ws, "running")
    kernels = client.get(f"/v1/workspaces/{ws}/api/kernels").json()
    assert [k["id"] for k in kernels] == [kernel]
    # A new process, with the variables (and the import) of the old one.
    assert run(f"print({started} != {birth.strip()!r}, v)") == "True 5\n"


def test_list_paginates(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user(org="paging", project="p")
    ids = {client.post("/v1/workspaces", json={"name": f"w{i}"}).json()["id"] for i in range(5)}
    seen: list[str] = []
    after = None
    while True:
        params: dict[str, str | int] = {"limit": 2}
        if after:
            params["after"] = after
        page = client.get("/v1/workspaces", params=params).json()
        seen += [w["id"] for w in page["items"]]
        after = page["next"]
        if not after:
            break
    assert seen == sorted(ids)


def test_bad_requests_get_problem_json(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    cases = [
        client.post("/v1/workspaces", json={}),
        client.post("/v1/workspaces", json={"name": ""}),
        client.post("/v1/workspaces", json={"name": "a", "gpus": 3}),
        client.post("/v1/workspaces", content=b"{not json",
                    headers={"content-type": "application/json"}),
    ]
    for response in cases:
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["detail"]
    unauthenticated = httpx.get(f"{shared_cluster.url}/v1/workspaces")
    assert unauthenticated.status_code == 401
    assert "Bearer" in unauthenticated.json()["detail"]
