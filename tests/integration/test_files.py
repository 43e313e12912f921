"""Workspace files: validation, path confinement, mirroring into a live kernel."""

from __future__ import annotations

import json

import nbformat
import pytest

from tests.support.cluster import (
    Cluster,
    create_running,
    outcome,
    run_cell,
    start_kernel,
    wait_state,
)


@pytest.fixture(scope="module")
def owner(shared_cluster: Cluster):  # type: ignore[no-untyped-def]
    client = shared_cluster.new_user(org="files", project="p")
    return client, create_running(client)


@pytest.mark.parametrize("body", [
    b"not json at all",
    b"{}",
    json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}}).encode(),
    json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                "cells": [{"cell_type": "bogus", "source": "", "metadata": {}}]}).encode(),
])
def test_malformed_notebooks_are_refused_and_not_stored(owner, body: bytes) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    response = client.put(f"/v1/workspaces/{ws}/files/bad.ipynb", content=body)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    assert "bad.ipynb is not a valid notebook" in response.json()["detail"]
    assert client.get(f"/v1/workspaces/{ws}/files/bad.ipynb").status_code == 404


def test_a_bad_save_keeps_the_previous_notebook(owner) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    good = nbformat.writes(nbformat.v4.new_notebook()).encode()
    assert client.put(f"/v1/workspaces/{ws}/files/keep.ipynb", content=good).status_code == 200
    assert client.put(f"/v1/workspaces/{ws}/files/keep.ipynb", content=b"{").status_code == 422
    assert client.get(f"/v1/workspaces/{ws}/files/keep.ipynb").content == good


@pytest.mark.parametrize("path", [
    "..%2F..%2Fetc%2Fpasswd",
    "a%2F..%2F..%2Fb",
    "%2Fetc%2Fpasswd",
    "a%2F%2Fb",
    "a%5Cb",
    "x%00y",
    ".%2Fa",
])
def test_path_traversal_is_refused(owner, path: str) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    for method in ("PUT", "GET", "DELETE"):
        response = client.request(method, f"/v1/workspaces/{ws}/files/{path}",
                                  content=b"x" if method == "PUT" else None)
        assert response.status_code == 422, (method, path, response.status_code, response.text)
        assert response.headers["content-type"] == "application/problem+json"


def test_symlinks_made_by_kernel_code_are_not_synced(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user(org="files", project="links")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    code = "import os; os.symlink('/etc/hostname', 'leak.txt'); open('real.txt', 'w').write('ok')"
    assert run_cell(shared_cluster, client, ws, kernel, code).status == "ok"
    client.post(f"/v1/workspaces/{ws}/suspend")
    wait_state(client, ws, "suspended")
    paths = {f["path"] for f in client.get(f"/v1/workspaces/{ws}/files").json()["files"]}
    assert "real.txt" in paths and "leak.txt" not in paths


def test_api_writes_reach_the_running_kernel(owner, shared_cluster: Cluster) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    kernel = start_kernel(client, ws)
    client.put(f"/v1/workspaces/{ws}/files/sub/dir/input.txt", content=b"from the api")

    def run(code: str) -> str:
        return outcome(run_cell(shared_cluster, client, ws, kernel, code))

    assert run("print(open('sub/dir/input.txt').read())") == "from the api\n"
    client.delete(f"/v1/workspaces/{ws}/files/sub/dir/input.txt")
    assert run("import os; print(os.path.exists('sub/dir/input.txt'))") == "False\n"


def test_missing_file_is_404(owner) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    assert client.get(f"/v1/workspaces/{ws}/files/nope.txt").status_code == 404
    assert client.delete(f"/v1/workspaces/{ws}/files/nope.txt").status_code == 404


def test_a_file_cannot_be_a_directory(owner) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    base = f"/v1/workspaces/{ws}/files"
    assert client.put(f"{base}/ok.txt", content=b"a file").status_code == 200
    for path in ("ok.txt/child.txt", "ok.txt/deeper/child.txt"):
        response = client.put(f"{base}/{path}", content=b"x")
        assert response.status_code == 409, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["detail"] == f"{path}: a parent of this path is a file"
        assert client.get(f"{base}/{path}").status_code == 404
        assert client.delete(f"{base}/{path}").status_code == 404
    assert client.put(f"{base}/dir/inner.txt", content=b"inner").status_code == 200
    response = client.put(f"{base}/dir", content=b"x")
    assert response.status_code == 409
    assert response.json()["detail"] == "dir: a directory of this name exists"
    assert client.get(f"{base}/dir").status_code == 404
    assert client.get(f"{base}/ok.txt").content == b"a file"


def test_names_longer_than_the_filesystem_allows_are_422(owner) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    base = f"/v1/workspaces/{ws}/files"
    longest = "x" * 255
    assert client.put(f"{base}/{longest}", content=b"ok").status_code == 200
    assert client.get(f"{base}/{longest}").content == b"ok"
    for path in ("x" * 256, "dir/" + "é" * 128 + "/f.txt"):
        for method in ("PUT", "GET", "DELETE"):
            response = client.request(method, f"{base}/{path}",
                                      content=b"x" if method == "PUT" else None)
            assert response.status_code == 422, (method, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            assert "at most 255 bytes" in response.json()["detail"]


def test_a_colon_is_an_ordinary_character(owner) -> None:  # type: ignore[no-untyped-def]
    client, ws = owner
    base = f"/v1/workspaces/{ws}/files"
    for path in ("a:b", "C:/notes.txt"):
        response = client.put(f"{base}/{path}", content=path.encode())
        assert response.status_code == 200, response.text
        assert response.json()["path"] == path
        assert client.get(f"{base}/{path}").content == path.encode()
