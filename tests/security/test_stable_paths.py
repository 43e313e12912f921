"""A workspace's paths inside the sandbox are fixed: the same after a suspend and a
resume in another slot, and none of them a host path (as root and unprivileged).

Measured before: the working directory moved on every resume
(``…/runtimes/warm-8f2f…/files`` became ``…/runtimes/ws_…/files``), so a variable
holding ``os.path.abspath("data.txt")`` or ``Path.cwd()`` dangled while the report
said "restored", ``sys.path`` and a module's ``__file__`` changed, and the kernel saw
the agent's state directory in all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cluster import (
    Cluster,
    create_running,
    resume,
    run_cell,
    start_kernel,
    suspend,
)
from tests.support.hostile import NEEDS_BWRAP
from tests.support.sandboxed import platform_as

pytestmark = [NEEDS_BWRAP, pytest.mark.no_db, pytest.mark.timeout(300)]

WHERE = """
import json, os, sys
from pathlib import Path
print(json.dumps({"cwd": os.getcwd(), "home": os.environ["HOME"],
                  "state": os.environ.get("NBFLEET_STATE_DIR", ""),
                  "target": os.environ.get("PIP_TARGET", ""),
                  "path": [p for p in sys.path if p and not p.startswith(sys.prefix)
                           and not p.startswith(sys.base_prefix)]}))
"""


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with platform_as(request.param, "nbf-paths-") as cluster:
        # A warm slot may take the workspace first; its resume gets another.
        cluster.start_agent(warm_pool=1, args=("--sandbox", "bwrap"))
        yield cluster


def _json(cluster: Cluster, client: Any, ws: str, kernel: str, code: str) -> Any:
    result = run_cell(cluster, client, ws, kernel, code)
    assert result.status == "ok", (result.reply, result.outputs)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_workspace_keeps_its_paths_across_a_resume_and_sees_none_of_the_host(
        cluster: Cluster) -> None:
    client = cluster.new_user(org="paths", project="p")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    before = _json(cluster, client, ws, kernel, WHERE)
    assert before["cwd"] == "/home/nbfleet/work", before
    assert before["home"] == "/home/nbfleet", before
    assert before["target"] == "/home/nbfleet/.nbfleet/packages", before
    assert before["state"].startswith("/home/nbfleet/.nbfleet/state/"), before
    assert str(cluster.root) not in json.dumps(before), before
    made = _json(cluster, client, ws, kernel, """
import json, os, sys
from pathlib import Path
data = os.path.abspath("data.txt")
open(data, "w").write("kept")
here = Path.cwd()
open(os.path.join(os.environ["PIP_TARGET"], "layered.py"), "w").write("X = 41\\n")
import importlib; importlib.invalidate_caches()
import layered
print(json.dumps({"data": data, "module": layered.__file__}))
""")
    assert made == {"data": "/home/nbfleet/work/data.txt",
                    "module": "/home/nbfleet/.nbfleet/packages/layered.py"}, made

    assert suspend(client, ws)["state"] == "suspended"
    restored = resume(client, ws)["restore"]["kernels"][kernel]
    assert {"data", "here", "layered"} <= set(restored["restored"]), restored
    after = _json(cluster, client, ws, kernel, """
import json, os
from pathlib import Path
print(json.dumps({"data": open(data).read(), "here": here == Path.cwd(),
                  "module": layered.__file__, "x": layered.X + 1, "cwd": os.getcwd()}))
""")
    assert after == {"data": "kept", "here": True, "x": 42, "cwd": "/home/nbfleet/work",
                     "module": "/home/nbfleet/.nbfleet/packages/layered.py"}, after
    again = _json(cluster, client, ws, kernel, WHERE)
    assert again == before | {"state": again["state"]}, (before, again)
    assert again["state"].startswith("/home/nbfleet/.nbfleet/state/"), again
