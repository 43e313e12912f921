"""Two fleets on one machine: agents with the same id leave each other's kernels alone.

An agent id is unique within its fleet only. A staging and a production agent on one
machine, or two test clusters, may both be ``host-00001``; each agent sweeps what an
earlier boot of itself left (its socket directory under /tmp, its cgroup, its
network namespaces) and removes them at shutdown. Named after the agent id alone,
those were the other agent's too: its kernels were killed, and their connection
files deleted so they could not restart (found when the two policies of
``tests/e2e/test_sim_live.py`` ran side by side).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import running_cluster
from tests.support.cluster import create_running, outcome, run_cell, start_kernel

pytestmark = pytest.mark.db_agnostic

TWIN = "host-twin"


def test_an_agent_with_the_same_id_neither_sweeps_nor_kills_the_other_fleets_kernels(
        tmp_path: Path) -> None:
    (tmp_path / "b" / "agent1").mkdir(parents=True)
    (tmp_path / "b" / "agent1" / "agent-id").write_text(TWIN)
    with running_cluster(tmp_path / "b") as fleet_b:
        user = fleet_b.new_user()
        workspace_id = create_running(user)
        kernel_id = start_kernel(user, workspace_id)
        assert outcome(run_cell(fleet_b, user, workspace_id, kernel_id,
                                "x = 41\nprint('set')")) == "set\n"

        (tmp_path / "a" / "agent1").mkdir(parents=True)
        (tmp_path / "a" / "agent1" / "agent-id").write_text(TWIN)
        with running_cluster(tmp_path / "a"):  # its agent starts: it sweeps its leftovers
            assert outcome(run_cell(fleet_b, user, workspace_id, kernel_id,
                                    "print(x + 1)")) == "42\n"
        # ... and stopped: it removed its sockets and ended its cgroup.
        assert outcome(run_cell(fleet_b, user, workspace_id, kernel_id,
                                "print(x + 2)")) == "43\n"
