"""An agent killed with kill -9 starts again, as root and as an unprivileged user;
a start-up that cannot clear what it finds exits with the reason.

As root every slot has a small tmpfs on its socket directory and an ext4 image on
its runtime directory. A kill -9 unmounts nothing, and the next start-up's
``rmtree(..., ignore_errors=True)`` left the mounted directories in place, then
raised ``FileExistsError`` making the socket directory again. uvicorn logged
"Application startup failed" and the process stayed up, holding its port and
answering nothing (``serve_all`` raised ``SystemExit`` inside the loop, so anyio's
worker threads were never told to stop and the interpreter waited for them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbfleet.agent.sandbox.quota import mounts_under
from nbfleet.agent.service import load_agent_id, local_id
from tests.support.cluster import (
    NBFLEET,
    Cluster,
    create_running,
    free_port,
    run_cell,
    start_kernel,
    wait_state,
)
from tests.support.hostile import NEEDS_BWRAP
from tests.support.sandboxed import platform_as, scratch_dir

pytestmark = [
    NEEDS_BWRAP,
    pytest.mark.no_db,  # the metadata DB is incidental
    pytest.mark.timeout(240),
]

#: As root these give each slot its disk image and its socket tmpfs: the mounts a
#: kill -9 leaves behind.
AGENT_ARGS = ("--sandbox", "bwrap", "--workspace-disk", "64MiB")


@pytest.fixture(params=["root", "unprivileged"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with platform_as(request.param, "nbf-restart-") as cluster:
        yield cluster


def test_an_agent_killed_with_its_mounts_in_place_starts_again(cluster: Cluster) -> None:
    cluster.start_agent(warm_pool=1, args=AGENT_ARGS)
    client = cluster.new_user(org="crash", project="p")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    client.put(f"/v1/workspaces/{ws}/files/kept.txt", content=b"kept").raise_for_status()
    assert run_cell(cluster, client, ws, kernel, "print(open('kept.txt').read())"
                    ).stdout == "kept\n"
    state_dir = str(cluster.root / "agent1")
    sockets = os.path.join(tempfile.gettempdir(),
                           f"nbfleet-{local_id(load_agent_id(state_dir), state_dir)}")
    if os.geteuid() == 0 and cluster.run_as is None:
        # What made the restart fail: the slots' mounts, under both directories.
        assert mounts_under(sockets), "a root agent mounts a tmpfs per socket directory"
        assert mounts_under(state_dir)
    agent = cluster.agents.pop("agent1")
    os.kill(agent.pid, signal.SIGKILL)  # the agent only: its mounts stay
    agent.wait(30)

    cluster.start_agent(warm_pool=1, args=AGENT_ARGS)  # waits for its registration
    wait_state(client, ws, "running")
    again = start_kernel(client, ws)
    assert run_cell(cluster, client, ws, again, "print(open('kept.txt').read())"
                    ).stdout == "kept\n"


@pytest.fixture(params=["root", "unprivileged"])
def home(request: pytest.FixtureRequest) -> Iterator[tuple[Path, tuple[int, int] | None]]:
    with scratch_dir(request.param, "nbf-startup-") as made:
        yield made


def test_a_start_up_that_cannot_clear_its_leftovers_exits_with_the_reason(
        home: tuple[Path, tuple[int, int] | None]) -> None:
    """``nbfleet up`` over something in the way of its agent's socket directory that
    it cannot remove: as root, a leftover that is itself a read-only mount (only what
    lies below is the agent's to unmount); unprivileged, one that another user owns.
    Either way the process must exit 1 and say why, not keep its port open."""
    root, run_as = home
    tmp, state = root / "tmp", root / "home"  # its TMPDIR: its own, as /tmp would be
    agent_dir = state / "agent"
    agent_dir.mkdir(parents=True)
    tmp.mkdir()
    agent_id = load_agent_id(str(agent_dir))
    if run_as is not None:
        for path in (tmp, state, agent_dir, agent_dir / "agent-id"):
            os.chown(path, *run_as)
    leftover = tmp / f"nbfleet-{local_id(agent_id, str(agent_dir))}"
    (leftover / "slot").mkdir(parents=True)
    read_only = os.geteuid() == 0 and run_as is None
    if read_only:
        subprocess.run(["mount", "--bind", str(leftover), str(leftover)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(leftover)], check=True)
    elif os.geteuid() != 0:
        pytest.skip("the tests run unprivileged: nobody else can own the leftover")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env.update(NBFLEET_HOME=str(state), TMPDIR=str(tmp), HOME=str(root))
    process = subprocess.Popen(
        [*NBFLEET, "up", "--port", str(port), "--sandbox", "bwrap", "--warm-pool", "0",
         "--workspace-disk", "64MiB"], env=env, cwd=root,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        **({"user": run_as[0], "group": run_as[1], "extra_groups": []} if run_as else {}))
    try:
        output, _ = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate(timeout=10)
        pytest.fail("nbfleet up went on running after its agent failed to start: "
                    + output.decode(errors="replace")[-2000:])
    log = output.decode(errors="replace")
    assert process.returncode == 1, log[-2000:]
    assert "the agent could not start" in log, log[-2000:]
    assert f"cannot remove what a previous run left at {leftover}" in log, log[-2000:]
