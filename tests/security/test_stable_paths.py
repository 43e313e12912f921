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
import os
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
    assert before["cwd"] == "/home/work", before
    assert before["home"] == "/home/nbfleet", before
    assert before["target"] == "/home/.nbfleet/packages", before
    assert before["state"].startswith("/home/.nbfleet/state/"), before
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
    assert made == {"data": "/home/work/data.txt",
                    "module": "/home/.nbfleet/packages/layered.py"}, made

    assert suspend(client, ws)["state"] == "suspended"
    restored = resume(client, ws)["restore"]["kernels"][kernel]
    assert {"data", "here", "layered"} <= set(restored["restored"]), restored
    after = _json(cluster, client, ws, kernel, """
import json, os
from pathlib import Path
print(json.dumps({"data": open(data).read(), "here": here == Path.cwd(),
                  "module": layered.__file__, "x": layered.X + 1, "cwd": os.getcwd()}))
""")
    assert after == {"data": "kept", "here": True, "x": 42, "cwd": "/home/work",
                     "module": "/home/.nbfleet/packages/layered.py"}, after
    again = _json(cluster, client, ws, kernel, WHERE)
    assert again == before | {"state": again["state"]}, (before, again)
    assert again["state"].startswith("/home/.nbfleet/state/"), again


#: What a review found against the first layout (mount points inside the home),
#: tried whatever the layout: move the home's own directories aside, plant links
#: where bubblewrap would make mount points, and leave marks in the directories it
#: binds, then restart: if it follows a link, a mark shows in /usr/bin.
PLANT = """
import json, os
home, done = os.environ["HOME"], []
open("marker-in-files.txt", "w").write("mine")
open(os.path.join(os.environ["PIP_TARGET"], "marker-in-packages.txt"), "w").write("mine")
for name in ("work", ".nbfleet"):
    try:
        os.rename(os.path.join(home, name), os.path.join(home, name + ".old"))
    except OSError:
        pass
os.makedirs(os.path.join(home, ".nbfleet"), exist_ok=True)
for name in ("work", ".nbfleet/packages", ".nbfleet/state"):
    try:
        os.symlink("/newroot/usr/bin", os.path.join(home, name))
        done.append("link ~/" + name)
    except OSError:
        pass
for path in ("/home/evil", "/home/.nbfleet/evil"):
    try:
        os.mkdir(path)
        done.append("mkdir " + path)
    except OSError:
        pass
for path in ("/home/work", "/home/.nbfleet", "/home/.nbfleet/packages", "/home/nbfleet"):
    try:
        os.rename(path, path + "-moved")
        done.append("rename " + path)
    except OSError:
        pass
print(json.dumps(done))
"""


def test_links_a_kernel_plants_change_nothing_the_agent_binds(cluster: Cluster) -> None:
    """Found in review of the first layout (mount points inside the home): a link
    planted at ``~/.nbfleet/packages -> /usr/bin`` had the root agent's bubblewrap
    bind the tenant's package layer over /usr/bin where it then runs ``setpriv``.
    Now the tenant can plant links in its home, where nothing is mounted, and can
    neither make nor move anything the agent binds."""
    client = cluster.new_user(org="planter", project="p")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    done = _json(cluster, client, ws, kernel, PLANT)
    if cluster.run_as is None and os.geteuid() == 0:
        # /home is the root agent's tmpfs: nothing there is the tenant's to change.
        assert not [d for d in done if not d.startswith("link ~/")], done
    # (An unprivileged sandbox owns its /home tmpfs; it is made anew at each start,
    # before any of its code runs, so nothing made there lasts: checked below.)
    restarted = client.post(f"/v1/workspaces/{ws}/api/kernels/{kernel}/restart")
    assert restarted.status_code == 200, restarted.text
    seen = _json(cluster, client, ws, kernel, """
import json, os
print(json.dumps({"cwd": os.getcwd(), "marker": os.path.exists("marker-in-files.txt"),
                  "evil": os.path.exists("/home/evil"),
                  "usr_bin": sorted(n for n in os.listdir("/usr/bin") if "marker" in n),
                  "env": os.path.exists("/usr/bin/env"),
                  "target": os.environ["PIP_TARGET"]}))
""")
    assert seen == {"cwd": "/home/work", "marker": True, "evil": False, "usr_bin": [],
                    "env": True, "target": "/home/.nbfleet/packages"}, seen
