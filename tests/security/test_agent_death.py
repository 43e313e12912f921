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
import signal

import pytest

from tests.support.cluster import wait_until
from tests.support.hostile import (
    NEEDS_BWRAP,
    PROLOGUE,
    descendants,
    kernel_host_pids,
    new_tenant,
)
from tests.support.sandboxed import platform_as

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
    with platform_as(mode, "nbf-death-") as cluster:
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
