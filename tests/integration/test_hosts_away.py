"""Every host away at once (agents killed, or stopped to be restarted), then back:
no workspace is left stuck. What was running, being created or being placed when
the hosts went runs again by itself once they return, CPU and GPU alike, under
the fleet scheduler's default policy (``nbfleet``); a workspace that cannot be
placed on any registered host fails saying why, and a resume asks again."""

from __future__ import annotations

import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from nbfleet.db.engine import Database
from nbfleet.db.tables import Workspace
from tests.integration.test_gpu_cells import fleet, funded
from tests.support.cluster import Cluster, wait_state, wait_until

pytestmark = pytest.mark.timeout(400)

A100 = {"gpus": 1, "gpu_types": ["A100-80GB"]}
H100 = {"gpus": 1, "gpu_types": ["H100-80GB"]}
#: The default policy; one replica a kernel, as each GPU kind is on one host only.
CONTROL = ("--policy", "nbfleet", "--replicas", "1", "--gpu-prices", "default=1")
#: How long a workspace may take to run once its hosts are back. A host's
#: registration ends the placements' backoff, so this is a placement's time with a
#: generous margin for a loaded machine, and well short of the backoff a long
#: outage builds up (``_as_after_a_long_outage``).
BACK_WITHIN_S = 120.0


def _create(client: httpx.Client, name: str, resources: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"name": name}
    if resources is not None:
        body["resources"] = resources
    response = client.post("/v1/workspaces", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _read(client: httpx.Client, workspace_id: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"/v1/workspaces/{workspace_id}").json()
    return body


def _waits(client: httpx.Client, workspace_id: str) -> bool:
    """Whether the workspace has been looked at with no host up and waits, saying
    why; it must never have failed for good (a wait is retried, a refusal not)."""
    body = _read(client, workspace_id)
    assert not (body["last_error"] or "").startswith("cannot place"), body
    return bool(body["last_error"]) and body["state"] != "failed"


def _start(cluster: Cluster, a100: str = "1xA100-80GB", h100: str = "1xH100-80GB") -> None:
    """Two GPU hosts of different kinds: whichever goes last, the scheduler's model
    is left knowing one kind only (or, when both go in one pass, neither)."""
    cluster.start_agent("a1", gpus=a100)
    cluster.start_agent("a2", gpus=h100)


def _as_after_a_long_outage(cluster: Cluster) -> None:
    """Every waiting workspace's backoff as a long outage leaves it (its tenth
    failed attempt: the next one minutes away), so that only the hosts' return
    can bring them back within ``BACK_WITHIN_S``."""
    db = Database(cluster.db_url)
    try:
        with db.transaction() as session:
            session.execute(update(Workspace).where(Workspace.pending.is_(True)).values(
                attempts=10, next_attempt_at=datetime.now(UTC) + timedelta(seconds=600)))
    finally:
        db.dispose()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_workspaces_run_again_by_themselves_once_every_host_is_back(
        tmp_path: Path, db_url: str, sig: signal.Signals) -> None:
    """Workspaces running (CPU and GPU), being placed as the agents stop, and
    created once none is up. The API accepts the GPU requests because registered
    hosts can hold them: the scheduler, whose model has emptied with the hosts,
    must not refuse them for good. Once the agents are back, all of them run
    without anybody asking again, however long their backoff had grown."""
    cluster = Cluster(tmp_path, db_url)
    try:
        cluster.start_control(args=CONTROL)
        _start(cluster)
        client = funded(cluster)
        running = [_create(client, "cpu-running"), _create(client, "a100-running", A100),
                   _create(client, "h100-running", H100)]
        for ws in running:
            wait_state(client, ws, "running")

        for name in ("a1", "a2"):
            cluster.kill_agent(name, sig)
        placing = [_create(client, "cpu-placing"), _create(client, "a100-placing", A100),
                   _create(client, "h100-placing", H100)]
        wait_until(lambda: fleet(cluster)["totals"]["hosts"] == 0, 60,
                   what="every host out of the scheduler's model")
        # Never placed anywhere: asked for once the scheduler knows no host at all.
        away = [_create(client, "cpu-away"), _create(client, "a100-away", A100),
                _create(client, "h100-away", H100)]
        for ws in placing + away:
            wait_until(lambda ws=ws: _waits(client, ws), 60, what=f"{ws} to wait, saying why")
        _as_after_a_long_outage(cluster)

        _start(cluster)
        for ws in running + placing + away:
            body = wait_state(client, ws, "running", timeout=BACK_WITHIN_S)
            assert body["last_error"] is None, body
    finally:
        cluster.stop()


def test_a_workspace_no_registered_host_can_hold_fails_saying_why_and_a_resume_clears_it(
        tmp_path: Path, db_url: str) -> None:
    """The H100 host comes back as an A100 one (its GPUs swapped): nothing
    registered can hold the suspended H100 workspace any more, so its resume fails,
    saying why in ``last_error``, and is not retried behind the user's back. Once
    the host has its H100 again, a second resume asks again and it runs."""
    cluster = Cluster(tmp_path, db_url)
    try:
        cluster.start_control(args=CONTROL)
        _start(cluster)
        client = funded(cluster)
        h100 = _create(client, "h100", H100)
        wait_state(client, h100, "running")
        assert client.post(f"/v1/workspaces/{h100}/suspend",
                           params={"wait": 120}).json()["state"] == "suspended"

        _swap_h100_host(cluster, "1xA100-80GB")
        client.post(f"/v1/workspaces/{h100}/resume")
        failed = wait_state(client, h100, "failed", timeout=BACK_WITHIN_S)
        assert failed["desired_state"] == "running"
        assert failed["last_error"].startswith("cannot place: "), failed
        assert "H100-80GB" in failed["last_error"], failed

        _swap_h100_host(cluster, "1xH100-80GB")
        # The host's return does not undo the failure (a wait would have ended):
        # only a request does.
        assert _read(client, h100)["state"] == "failed"
        response = client.post(f"/v1/workspaces/{h100}/resume", params={"wait": 50})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["state"] == "running" and body["last_error"] is None, body
    finally:
        cluster.stop()


def _swap_h100_host(cluster: Cluster, gpus: str) -> None:
    """Stop the second host, wait until the scheduler has forgotten it, and start
    it again (same host id) with ``gpus``."""
    cluster.kill_agent("a2", signal.SIGKILL)
    wait_until(lambda: fleet(cluster)["totals"]["hosts"] == 1, 60,
               what="the second host out of the scheduler's model")
    cluster.start_agent("a2", gpus=gpus)
    wait_until(lambda: fleet(cluster)["totals"]["hosts"] == 2, 60,
               what="the second host back in the scheduler's model")
