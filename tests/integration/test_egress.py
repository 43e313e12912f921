"""Egress mode: a project's kernels reach the public internet, and still nothing of
the platform's hosts, private ranges or link-local addresses.

Nothing here sends a packet off this machine: the reachable side is shown by the
namespace's route and resolver, the refused side against a listener of the test's
own on this machine's primary address (private or reserved on most hosts; here
192.0.2.2)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import running_cluster
from tests.support.cluster import Cluster, create_running, run_cell, start_kernel, wait_until
from tests.support.hostile import network_probe

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("bwrap", "slirp4netns", "nft")),
    reason="egress needs a root agent, bubblewrap, slirp4netns and nftables (.ci/run "
           "installs them)")


def probe(cluster: Cluster, client: httpx.Client, workspace_id: str, kernel_id: str,
          targets: list[tuple[str, int]]) -> dict[str, Any]:
    result = run_cell(cluster, client, workspace_id, kernel_id, network_probe(targets))
    verdict: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return verdict


def primary_address() -> str:
    """This machine's own address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never contacted
        return str(probe.getsockname()[0])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("egress")
    with running_cluster(root, agent_args=("--sandbox", "bwrap")) as running:
        yield running


def test_an_egress_project_routes_out_but_reaches_nothing_of_this_host(
        cluster: Cluster) -> None:
    client = cluster.new_user(org="net", project="open")
    answer = cluster.admin().put("/v1/admin/orgs/net/projects/open/settings",
                                 json={"network": "egress"})
    assert answer.status_code == 200, answer.text
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    address = primary_address()
    with socket.socket() as listener:
        listener.bind((address, 0))
        listener.listen()
        targets = [(address, listener.getsockname()[1]), ("10.0.2.2", cluster.port),
                   ("127.0.0.1", cluster.port)]
        verdict = probe(cluster, client, ws, kernel, targets)
    assert verdict["default_routes"] == ["tap0"], verdict
    assert "nameserver 10.0.2.3" in verdict["resolv"]
    assert verdict["reached"] == [], verdict
    agent = cluster.admin().get("/v1/admin/agents").json()["items"][0]
    assert agent["inventory"]["isolation"]["egress"]["active"] is True

    # Other projects keep no network at all; the namespace goes with the workspace.
    other = cluster.new_user(org="closed")
    closed = create_running(other)
    closed_kernel = start_kernel(other, closed)
    assert probe(cluster, other, closed, closed_kernel, [])["default_routes"] == []
    client.delete(f"/v1/workspaces/{ws}").raise_for_status()

    def gone() -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return ws not in listed

    wait_until(gone, 30, what="the egress namespace to go")
