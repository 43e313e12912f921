"""A GPU is reachable only from the slot it is bound to now, and stays its slot's
while any of its processes holds it open (issue 27, point 9).

Measured before: every GPU slot got all of the host's ``/dev/nvidia*`` nodes and
the per-cell binding was only ``CUDA_VISIBLE_DEVICES``, so a cell bound to GPU 0
opened GPU 1, bound to another tenant's running cell, and kept GPU 0 after its
release.

No GPU here: the nodes are character devices with NVIDIA's numbers, made by the
test in a directory the agent is told to take its GPUs from
(``$NBFLEET_GPU_DEVICE_DIR``). No driver answers them, so an ``open`` the device
cgroup lets through fails with ENXIO, where a real GPU opens; one it refuses fails
with EPERM. ``reachable`` below means the first (or a real open), ``refused`` the
second. A file descriptor held after the release is an ``O_PATH`` one here (no
driver to open the device through): the check at release counts those too.

The agent runs in this process, as root, with the real sandbox and cgroups (the
agent-level part runs as root only: an unprivileged agent has no device cgroup,
see ``test_gpu_isolation_unprivileged.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.runtimes import RuntimeManager
from nbfleet.agent.sandbox import open_isolation
from nbfleet.agent.sandbox.devices import DEVICE_DIR_ENV, NVIDIA_MAJOR
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles
from tests.integration.test_cell_bindings_agent import bound, execute_request, run, until
from tests.support.hostile import NEEDS_BWRAP

pytestmark = [
    NEEDS_BWRAP,
    pytest.mark.no_db,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups need a root agent"),
    pytest.mark.skipif(not os.path.isdir("/sys/fs/cgroup/devices"),
                       reason="no cgroup v1 devices controller mounted"),
]

#: /dev/nvidia-uvm's major is the driver's choice at load time; any free one will do.
UVM_MAJOR = 235

#: Tries to open every GPU node in its /dev; prints what each open answered.
PROBE = """
import errno, json, os
seen = {}
for name in sorted(os.listdir('/dev')):
    if name.startswith('nvidia') and not os.path.isdir('/dev/' + name):
        try:
            os.close(os.open('/dev/' + name, os.O_RDWR))
            seen[name] = 'opened'
        except OSError as exc:
            seen[name] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(seen))
"""


def verdict(seen: dict[str, str]) -> dict[str, str]:
    """opened, or refused by the driver (none here): the cgroup let it through."""
    return {name: "refused" if answer == "EPERM" else "reachable"
            for name, answer in seen.items()}


@pytest.fixture
def device_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="nbf-gpus-", dir="/var/tmp")
    nodes = {"nvidia0": (NVIDIA_MAJOR, 0), "nvidia1": (NVIDIA_MAJOR, 1),
             "nvidiactl": (NVIDIA_MAJOR, 255), "nvidia-uvm": (UVM_MAJOR, 0)}
    for name, (major, minor) in nodes.items():
        os.mknod(os.path.join(directory, name), 0o666 | stat.S_IFCHR,
                 os.makedev(major, minor))
        os.chmod(os.path.join(directory, name), 0o666)
    monkeypatch.setenv(DEVICE_DIR_ENV, directory)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def agent(device_dir: str) -> AsyncIterator[tuple[RuntimeManager, list[str]]]:
    root = Path(tempfile.mkdtemp(prefix="nbf-gpuiso-", dir="/var/tmp"))
    sockets = tempfile.mkdtemp(prefix="nbf-", dir="/tmp")  # IPC paths must stay short
    state = str(root / "agent")
    isolation = open_isolation("bwrap", [state, sockets], os.path.join(state, "sandbox"),
                               uuid.uuid4().hex[:8])
    assert isolation.report["gpus"][0], isolation.report
    reported: list[str] = []
    runtimes = RuntimeManager(state, WorkspaceFiles(BlobStore(str(root / "blobs"))), sockets,
                              isolation=isolation, on_released=reported.extend)
    try:
        yield runtimes, reported
    finally:
        await runtimes.shutdown()
        isolation.close()
        shutil.rmtree(sockets, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


async def gpu_kernel(runtimes: RuntimeManager, workspace_id: str) -> KernelProcess:
    placed = await runtimes.ensure(workspace_id, 1, [(f"k_{workspace_id}", "python3")], gpus=1)
    return placed.runtime.kernels[f"k_{workspace_id}"]


async def probe(kernel: KernelProcess, *indices: int, code: str = "") -> dict[str, str]:
    """Run ``code`` then the probe in one cell, bound to ``indices`` (none: unbound)."""
    source = code + PROBE
    request = bound(kernel, source, *indices) if indices else execute_request(source)
    reply, out = await run(kernel, kernel.attach(), request)
    assert reply["status"] == "ok", (reply, out)
    return verdict(json.loads(out.strip().splitlines()[-1]))


async def test_a_cell_opens_only_the_gpus_bound_to_it_now(
        agent: tuple[RuntimeManager, list[str]]) -> None:
    runtimes, reported = agent
    kernel = await gpu_kernel(runtimes, "ws_a")
    # Bound to GPU 0 only: GPU 1 (another tenant's, or nobody's) is refused, whatever
    # CUDA_VISIBLE_DEVICES says; the control nodes are reachable while a GPU is.
    seen = await probe(kernel, 0, code="import os\nos.environ['CUDA_VISIBLE_DEVICES'] = '0,1'\n")
    assert seen == {"nvidia-uvm": "reachable", "nvidia0": "reachable",
                    "nvidia1": "refused", "nvidiactl": "reachable"}, seen
    await until(lambda: len(reported) == 1)
    # After the release nothing is reachable, from the kernel or a child of it.
    seen = await probe(kernel)
    assert set(seen.values()) == {"refused"}, seen
    child = ("import subprocess, sys\n"
             f"print(subprocess.run([sys.executable, '-c', {PROBE!r}], capture_output=True,"
             " text=True).stdout)\n")
    reply, out = await run(kernel, kernel.attach(), bound(kernel, child, 1))
    assert reply["status"] == "ok", out
    seen = verdict(json.loads(out.strip().splitlines()[-1]))
    assert seen["nvidia1"] == "reachable" and seen["nvidia0"] == "refused", seen


async def test_a_gpu_held_open_after_its_cell_stays_its_slots(
        agent: tuple[RuntimeManager, list[str]]) -> None:
    """The cell keeps a descriptor of GPU 0 past its reply: the cell is not reported
    released (it is listed as held, so the control plane keeps GPU 0 committed and
    billed), and another tenant's cell bound to GPU 0 cannot open it, until the
    descriptor is closed."""
    runtimes, reported = agent
    holder = await gpu_kernel(runtimes, "ws_holder")
    other = await gpu_kernel(runtimes, "ws_other")
    held: list[str] = []
    holder.bindings.on_held = held.extend
    request = bound(holder, "import os\nkept = os.open('/dev/nvidia0', os.O_PATH)\n", 0)
    reply, out = await run(holder, holder.attach(), request)
    assert reply["status"] == "ok", out
    task = f"{holder.id}/{request.msg_id}"
    await until(lambda: any(a.held for a in holder.bindings.active(holder.id)))
    assert [(a.binding.task_id, a.held) for a in holder.bindings.active(holder.id)] == \
        [(task, True)]
    assert task not in reported
    await until(lambda: held == [task])  # told once: the control plane keeps it committed
    # Bound to GPU 0 by a control plane that did not wait for the agent: refused here.
    seen = await probe(other, 0)
    assert seen["nvidia0"] == "refused" and seen["nvidia1"] == "refused", seen
    assert task not in reported
    # Closed: the holder's cell is reported released, and GPU 0 is the next cell's.
    await probe(holder, code="os.close(kept)\n")
    await until(lambda: task in reported)
    assert holder.bindings.active(holder.id) == []
    seen = await probe(other, 0)
    assert seen["nvidia0"] == "reachable", seen


async def test_a_kernel_that_dies_holding_a_gpu_releases_it(
        agent: tuple[RuntimeManager, list[str]]) -> None:
    runtimes, reported = agent
    kernel = await gpu_kernel(runtimes, "ws_dies")
    request = bound(kernel, "import os\nkept = os.open('/dev/nvidia1', os.O_PATH)\n", 1)
    reply, _ = await run(kernel, kernel.attach(), request)
    assert reply["status"] == "ok"
    task = f"{kernel.id}/{request.msg_id}"
    await until(lambda: any(a.held for a in kernel.bindings.active(kernel.id)))
    await kernel.restart()
    await until(lambda: task in reported)
    assert reported.count(task) == 1 and kernel.bindings.active(kernel.id) == []
