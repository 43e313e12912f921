"""Nothing a sandbox runs outlives its agent, a kill -9 included (run as root and
as an unprivileged user, as CI does).

An agent that crashed and came back starts with a new boot: it knows nothing of
the kernels its last boot ran. Any that survived would hold memory and GPUs no
scheduler counts, and go on running a tenant's code unbilled. As root, behind the
switch into the slot's uid (``setpriv``) the inner bubblewrap's --die-with-parent
did not fire, and every kernel outlived its agent; the outer sandbox's PID
namespace now ends them all. A kernel that detaches a process of its own (a new
session, its parent gone) must not escape that either.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from tests.conftest import fresh_database
from tests.support.cluster import Cluster, wait_until
from tests.support.hostile import (
    NEEDS_BWRAP,
    PROLOGUE,
    descendants,
    kernel_host_pids,
    new_tenant,
    platform_user,
)

pytestmark = [
    NEEDS_BWRAP,
    # The metadata DB is incidental: the PostgreSQL pass need not repeat it.
    pytest.mark.no_db,
    pytest.mark.timeout(180),
]

#: Leaves a process of its own behind: double-forked, in a session of its own.
DETACH = PROLOGUE + """
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
os.wait()
print(json.dumps({"detached": True}))
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (one left for an init that does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["root", "unprivileged"])
def test_a_killed_agent_leaves_none_of_its_sandboxes_running(mode: str) -> None:
    run_as = platform_user(mode)
    # Outside /tmp: an unprivileged platform must reach its directories.
    root = Path(tempfile.mkdtemp(prefix="nbf-death-", dir="/var/tmp"))
    try:
        with fresh_database(root) as url:
            cluster = Cluster(root, url, run_as=run_as)
            try:
                cluster.start_control()
                cluster.start_agent(args=("--sandbox", "bwrap"))
                tenant = new_tenant(cluster, "crashed")
                assert tenant.run(cluster, DETACH) == {"detached": True}
                agent = cluster.agents.pop("agent1")
                kernels = kernel_host_pids(agent.pid)
                assert kernels, "no kernel found below the agent"
                sandboxed = descendants(agent.pid)
                # The kernel, its sandbox's processes and the detached one.
                assert len(sandboxed) > len(kernels) + 1, sandboxed
                os.kill(agent.pid, signal.SIGKILL)  # the agent only, not its group
                agent.wait(30)
                wait_until(lambda: not [pid for pid in sandboxed if _running(pid)], 15,
                           0.1, "every sandboxed process gone")
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
