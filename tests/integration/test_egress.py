"""Egress mode: a project's kernels reach the public internet, and still nothing of
the platform's hosts, private ranges or link-local addresses.

Nothing here sends a packet off this machine: the reachable side is shown by the
namespace's route and resolver, the refused side against a listener of the test's
own on this machine's primary address (a private one, as on most hosts)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import running_cluster
from tests.support.cluster import Cluster, create_running, run_cell, start_kernel, wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("bwrap", "slirp4netns", "nft")),
    reason="egress needs a root agent, bubblewrap, slirp4netns and nftables (.ci/run "
           "installs them)")

PROBE = """import json, socket
routes = [l.split()[0] for l in open('/proc/net/route').read().splitlines()[1:]
          if l.split()[1] == '00000000']
reached = []
for host, port in {targets!r}:
    with socket.socket() as s:
        s.settimeout(3)
        try:
            s.connect((host, port))
            reached.append(f'{{host}}:{{port}}')
        except OSError:
            pass
print(json.dumps({{"default_routes": routes, "resolv": open('/etc/resolv.conf').read(),
                  "reached": reached}}))
"""


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
        result = run_cell(cluster, client, ws, kernel, PROBE.format(targets=targets))
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict["default_routes"] == ["tap0"], verdict
    assert "nameserver 10.0.2.3" in verdict["resolv"]
    assert verdict["reached"] == [], verdict
    agent = cluster.admin().get("/v1/admin/agents").json()["items"][0]
    assert agent["inventory"]["isolation"]["egress"]["active"] is True

    # Other projects keep no network at all; the namespace goes with the workspace.
    other = cluster.new_user(org="closed")
    closed = create_running(other)
    closed_kernel = start_kernel(other, closed)
    shut = run_cell(cluster, other, closed, closed_kernel, PROBE.format(targets=[]))
    assert json.loads(shut.stdout.strip().splitlines()[-1])["default_routes"] == []
    client.delete(f"/v1/workspaces/{ws}").raise_for_status()

    def gone() -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return ws not in listed

    wait_until(gone, 30, what="the egress namespace to go")
