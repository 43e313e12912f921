"""A hostile notebook against a live platform: every attack the evaluation measured,
run from inside a real kernel, and the containment that must hold.

The platform runs twice: as root (how ``nbfleet up`` runs in CI and on most
hosts) and as an unprivileged user (``nobody``, with a delegated cgroup subtree).
Each test names the attack in its docstring; a failure message lists what got
through. Everything the probes do is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nbfleet.agent.service import local_id
from nbfleet.sdk.kernel_socket import KernelSocket
from tests.conftest import fresh_database
from tests.support.cluster import Cluster, token_of, wait_state, wait_until
from tests.support.hostile import (
    DEVICES_AND_RAW_OUTPUT,
    DISK_LIMIT_MIB,
    IDENTITY,
    LIMIT_ARGS,
    NEEDS_BWRAP,
    PIDS_LIMIT,
    SYSCALLS,
    TAMPER,
    Battlefield,
    cpu_hog,
    delegated_cgroups,
    disk_bomb,
    fork_bomb,
    host_uid,
    kernel_host_pids,
    memory_bomb,
    network_probe,
    new_tenant,
    platform_user,
    read_probe,
    signal_probe,
)

pytestmark = [
    NEEDS_BWRAP,
    # The metadata DB is incidental here: the sandbox is the same on either, so the
    # PostgreSQL pass need not repeat these.
    pytest.mark.no_db,
]

SECRET = "tenant-b-private-" + uuid.uuid4().hex


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def field(request: pytest.FixtureRequest) -> Iterator[Battlefield]:
    mode = str(request.param)
    run_as = platform_user(mode)
    # Outside /tmp (which every sandbox replaces anyway), like an NBFLEET_HOME in a
    # checkout, so hiding the platform's directories is what the probes test.
    root = Path(tempfile.mkdtemp(prefix="nbf-hostile-", dir="/var/tmp"))
    cgroups: contextlib.AbstractContextManager[str | None] = contextlib.nullcontext(None)
    if run_as is not None:
        cgroups = delegated_cgroups(*run_as, f"nbfleet-test-{uuid.uuid4().hex[:8]}")
    try:
        with cgroups as cgroup_parent, fresh_database(root) as url:
            cluster = Cluster(root, url, run_as=run_as)
            try:
                cluster.start_control()
                agent_args = [*LIMIT_ARGS, "--sandbox", "bwrap"]
                if cgroup_parent is not None:
                    agent_args += ["--cgroup-parent", cgroup_parent]
                cluster.start_agent(args=tuple(agent_args))
                yield _deploy(mode, cluster)
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _deploy(mode: str, cluster: Cluster) -> Battlefield:
    attacker = new_tenant(cluster, "mallory")
    victim = new_tenant(cluster, "victim")
    put = victim.client.put(f"/v1/workspaces/{victim.workspace_id}/files/secret.txt",
                            content=SECRET.encode())
    put.raise_for_status()
    agent = cluster.agents["agent1"]
    assert cluster.control is not None
    kernels = wait_until(lambda: len(kernel_host_pids(agent.pid)) >= 2 and
                         kernel_host_pids(agent.pid), 30, what="both kernels")
    # Each kernel sees its files at the same path: the victim's is the one whose
    # working directory holds its secret (read through /proc from the host).
    victim_pid = next(pid for pid in kernels
                      if os.path.exists(f"/proc/{pid}/cwd/secret.txt"))
    attacker_pid = next(pid for pid in kernels if pid != victim_pid)
    agents = cluster.admin().get("/v1/admin/agents").json()["items"]
    agent_id = (cluster.root / "agent1" / "agent-id").read_text().strip()
    sockets = (Path(tempfile.gettempdir()) /
               f"nbfleet-{local_id(agent_id, str(cluster.root / 'agent1'))}" /
               victim.workspace_id)
    secrets = {
        "admin-token": str(cluster.home / "admin-token"),
        "cluster-secret": str(cluster.home / "cluster-secret"),
        "agent state": str(cluster.root / "agent1" / "agent-id"),
        "victim's file": str(cluster.root / "agent1" / "runtimes" / victim.workspace_id /
                             "files" / "secret.txt"),
        "victim's kernel key": str(sockets / f"kernel-{victim.kernel_id}.json"),
        "/etc/shadow": "/etc/shadow",
    }
    if (cluster.home / "nbfleet.db").exists():
        secrets["metadata DB"] = str(cluster.home / "nbfleet.db")
    # Each target is really there: a probe of a path that does not exist reads
    # nothing whatever the sandbox does (the kernel key's path went stale once).
    missing = [name for name, path in secrets.items() if not os.path.exists(path)]
    assert not missing, f"attack targets missing on the host: {missing}"
    outside = cluster.root / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep")
    if cluster.run_as is not None:
        for path in (outside, outside / "victim.txt"):
            os.chown(path, *cluster.run_as)
    return Battlefield(
        mode, cluster, attacker, victim,
        host_pids={"control plane": cluster.control.pid, "agent": agent.pid,
                   "victim's kernel": victim_pid, "attacker's own kernel": attacker_pid},
        secrets=secrets, agent_port=int(agents[0]["url"].rsplit(":", 1)[1]),
        isolation=agents[0].get("inventory", {}).get("isolation", {}), outside=outside)


def _outside_pids(field: Battlefield) -> list[int]:
    return [pid for name, pid in field.host_pids.items() if name != "attacker's own kernel"]


# ----------------------------------------------------------------- identity
def test_the_kernel_has_no_capabilities_and_is_never_root(field: Battlefield) -> None:
    """Measured: uid 0 with CapEff 000001fffeffffff."""
    seen = field.attacker.run(field.cluster, IDENTITY)
    for caps in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert int(seen[caps], 16) == 0, seen
    assert seen["NoNewPrivs"] == "1" and seen["Seccomp"] == "2", seen
    attacker_uid = host_uid(field.host_pids["attacker's own kernel"])
    victim_uid = host_uid(field.host_pids["victim's kernel"])
    agent_uid = host_uid(field.host_pids["agent"])
    assert attacker_uid != 0
    if field.mode == "root":  # each slot is its own unprivileged uid, never the agent's
        assert attacker_uid not in (agent_uid, victim_uid)
        assert field.isolation["uid"]["active"] is True
    else:  # the documented residual: an unprivileged agent cannot switch uids
        assert attacker_uid == agent_uid
        assert field.isolation["uid"]["active"] is False


# ------------------------------------------------------------------- files
def test_no_route_reads_the_platforms_or_another_tenants_files(field: Battlefield) -> None:
    """Measured: admin-token, cluster-secret and nbfleet.db read through
    /proc/<agent>/root; another tenant's files and kernel key through /proc/<pid>/cwd;
    /etc/shadow readable; the agent's secret in /proc/<pid>/cmdline."""
    verdict = field.attacker.run(
        field.cluster, read_probe(list(field.secrets.values()), _outside_pids(field)))
    assert verdict["read"] == {}, f"read through the sandbox: {verdict['read']}"
    visible = set(verdict["visible_pids"])
    assert not visible & set(field.host_pids.values()), visible
    assert len(visible) < 10, f"sees {len(visible)} processes: not its own namespace"


def test_the_victims_secret_never_appears_anywhere_the_attacker_can_read(
        field: Battlefield) -> None:
    """A search by content, not by path: grep what the sandbox can see for the
    victim's secret (bounded: the writable and usual places, 20,000 files)."""
    # The secret is spelled backwards in the probe: the probe's own source (kept in
    # the attacker's IPython history, in its home) must not be a hit.
    code = f"""import os, json
needle = {SECRET[::-1]!r}[::-1].encode()
hits, seen = [], 0
def files():
    for top in ("/tmp", "/proc/self/cwd", "/home", "/root", "/run", "/var/tmp", "/dev/shm",
                "/work", "/srv", "/opt"):
        for root, dirs, names in os.walk(top):
            for name in names:
                yield os.path.join(root, name)
for path in files():
    seen += 1
    if seen > 20000:
        break
    try:
        with open(path, "rb") as handle:
            if needle in handle.read(1 << 20):
                hits.append(path)
    except OSError:
        pass
print(json.dumps({{"hits": hits, "seen": seen}}))
"""
    verdict = field.attacker.run(field.cluster, code)
    assert verdict["hits"] == [], verdict


def test_the_kernel_cannot_rearrange_what_the_agent_binds_into_it(field: Battlefield) -> None:
    """Found in review: a kernel that owned its slot could swap its /tmp for a
    symlink to any host directory, or its connection file for a symlink the agent
    would chown, then restart itself. What is bound into it is a mount point it
    cannot move, and its slot's own directory is not in its view at all."""
    verdict = field.attacker.run(field.cluster, TAMPER)
    assert verdict["done"] == [], verdict


def test_devices_work_and_raw_output_stays_out_of_the_agents_log(field: Battlefield) -> None:
    """/dev/null, /dev/urandom and subprocess.DEVNULL work (a root agent's sandbox
    once refused every device node); what the kernel writes to its own fds 1 and 2
    never reaches the agent's log or terminal."""
    verdict = field.attacker.run(field.cluster, DEVICES_AND_RAW_OUTPUT)
    assert verdict == {"random": 16, "status": 0}, verdict
    log = (field.cluster.logs / "agent1.log").read_text(errors="replace")
    assert "RAW-STDOUT-MARKER" not in log and "RAW-STDERR-MARKER" not in log


# ----------------------------------------------------------------- signals
def test_signals_reach_no_process_outside_the_workspace(field: Battlefield) -> None:
    """Measured: SIGSTOP to the control plane (/healthz 0.02 s -> 2.4 s) and SIGKILL
    to another tenant's kernel."""
    verdict = field.attacker.run(field.cluster, signal_probe(_outside_pids(field)))
    assert verdict["delivered"] == {}, verdict
    for name, pid in field.host_pids.items():
        if name == "attacker's own kernel":
            continue
        with open(f"/proc/{pid}/status") as handle:
            state = next(line for line in handle if line.startswith("State:"))
        assert "T (stopped)" not in state, (name, state)
    assert httpx.get(f"{field.cluster.url}/healthz", timeout=5).status_code == 200
    assert "ok" in field.victim.run(field.cluster, "print('{\"ok\": 1}')")


# ----------------------------------------------------------------- network
def test_the_network_reaches_nothing_on_the_host(field: Battlefield) -> None:
    """Measured: a kernel connected to PostgreSQL as superuser and to the control
    plane's and agent's ports. Inside its namespace there is only its own loopback
    and no route at all, so no other address is reachable either (private ranges,
    the cloud metadata service): that is read from its routing table, without
    sending a packet anywhere but to this host's loopback."""
    targets = [(host, port) for port in (field.cluster.port, field.agent_port, 5432)
               for host in ("127.0.0.1", "::1")]
    verdict = field.attacker.run(field.cluster, network_probe(
        targets, ["/run/postgresql/.s.PGSQL.5432", "/var/run/postgresql/.s.PGSQL.5432"]))
    assert verdict["reached"] == [], verdict
    assert verdict["routes"] == [], verdict
    assert verdict["devices"] == ["lo"], verdict


# ---------------------------------------------------------------- syscalls
def test_the_syscalls_container_runtimes_refuse_are_refused(field: Battlefield) -> None:
    outcomes = field.attacker.run(field.cluster, SYSCALLS)
    allowed = {name: errno.errorcode.get(code, code) for name, code in outcomes.items()
               if code != errno.EPERM}
    assert allowed == {}, f"not refused with EPERM: {allowed}"


# ------------------------------------------------------------------- bombs
def test_a_fork_bomb_stops_at_the_process_limit(field: Battlefield) -> None:
    """Measured: 1,000 processes in 1.5 s. Bounded at 1,000 attempts."""
    verdict = field.attacker.run(field.cluster, fork_bomb(1000))
    assert verdict["forked"] < PIDS_LIMIT, verdict
    assert verdict["refusal"] == "EAGAIN", verdict


def test_a_cpu_hog_gets_its_one_cpu_and_no_more(field: Battlefield) -> None:
    """Measured: 8 busy loops made another tenant's cell 4x slower. The hog's own
    CPU time over 3 s of wall time shows the limit (bench/isolation.py measures the
    neighbour's slowdown)."""
    verdict = field.attacker.run(field.cluster, cpu_hog(4, 3.0))
    assert verdict["cpu_s"] / verdict["wall_s"] <= 1.2, verdict


def test_a_disk_bomb_fails_in_the_cell_and_nowhere_else(field: Battlefield) -> None:
    """Measured: 2 GiB written with no quota; a full NBFLEET_HOME broke SQLite for
    every tenant. Bounded at 4x the quota."""
    if field.mode != "root":
        # Loop-mounted quotas need root; the platform says so rather than pretend.
        assert field.isolation["disk"]["active"] is False
        assert "root" in field.isolation["disk"]["detail"]
        return
    assert field.isolation["disk"]["active"] is True
    for where in (".", "/tmp"):
        verdict = field.attacker.run(field.cluster, disk_bomb(where, 4 * DISK_LIMIT_MIB))
        assert verdict["refusal"] in ("ENOSPC", "EDQUOT"), (where, verdict)
        assert verdict["written_mib"] <= DISK_LIMIT_MIB, (where, verdict)
    created = field.cluster.admin().post("/v1/admin/users",
                                         json={"name": "after-bomb", "org": "o", "project": "p"})
    assert created.status_code in (200, 201), created.text
    assert "ok" in field.victim.run(field.cluster, "print('{\"ok\": 1}')")


def test_a_memory_bomb_stops_only_the_kernel_and_says_why(field: Battlefield) -> None:
    """Measured: 8 GiB allocated unchecked. Bounded at 2 GiB."""
    tenant = field.attacker
    messages = asyncio.run(_run_until_told(field.cluster, tenant.client, tenant.workspace_id,
                                           tenant.kernel_id, memory_bomb(2048)))
    told = [m for m in messages if "memory limit" in m]
    assert told, messages
    assert "384 MiB" in told[0]
    # The kernel comes back, the workspace keeps working, and says what happened.
    wait_until(lambda: tenant.run(field.cluster, "print('{\"back\": 1}')")["back"] == 1, 60,
               what="the kernel to restart")
    workspace = wait_until(
        lambda: (body := tenant.client.get(f"/v1/workspaces/{tenant.workspace_id}").json())
        and "memory limit" in (body.get("last_error") or "") and body, 20,
        what="last_error")
    assert workspace["state"] == "running"
    assert "ok" in field.victim.run(field.cluster, "print('{\"ok\": 1}')")


async def _run_until_told(cluster: Cluster, client: httpx.Client, workspace_id: str,
                          kernel_id: str, code: str) -> list[str]:
    """Run a cell that kills its kernel; collect what the notebook is told."""
    sock = await KernelSocket.connect(cluster.channels_url(workspace_id, kernel_id),
                                      token_of(client))
    texts: list[str] = []
    try:
        request = sock.message("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}, "shell")
        await sock.send(request)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any("memory limit" in t for t in texts):
            message: dict[str, Any] = await sock.receive(max(0.1, deadline - time.monotonic()))
            if message.get("msg_type") in ("stream", "error"):
                content = message["content"]
                texts.append(content.get("text") or content.get("evalue") or "")
    finally:
        await sock.close()
    return texts


# ----------------------------------------------------- links (runs last: it resumes)
def test_links_a_kernel_plants_never_lead_the_agent_outside(field: Battlefield) -> None:
    """Found in review: the agent, often root, followed links the kernel planted in
    its own directories: an API write or delete through ``d -> /etc`` wrote or
    deleted host files, a suspend uploaded what a link pointed at, and a restore
    wrote the snapshot through a link a ``sitecustomize`` planted in the kernel's
    state directory. Here the links point at a host directory the kernel cannot
    see; nothing may arrive there, leave it, or come back from it."""
    attacker, outside = field.attacker, str(field.outside)
    api = f"/v1/workspaces/{attacker.workspace_id}/files"
    plant = f"""import os, json
os.symlink({outside!r}, "d")
os.symlink({outside + "/victim.txt"!r}, "leak.txt")
site = os.path.join(os.environ["PYTHONPATH"], "sitecustomize.py")
with open(site, "w") as handle:
    handle.write("import os, shutil\\n"
                 "d = os.environ.get('NBFLEET_STATE_DIR')\\n"
                 "if d:\\n"
                 "    shutil.rmtree(d, ignore_errors=True)\\n"
                 "    os.makedirs(d, exist_ok=True)\\n"
                 "    os.symlink({outside!r}, os.path.join(d, 'blobs'))\\n")
kept = list(range(10))
print(json.dumps({{"planted": True}}))
"""
    assert attacker.run(field.cluster, plant) == {"planted": True}
    attacker.client.put(f"{api}/d/victim.txt", content=b"overwritten")
    attacker.client.delete(f"{api}/d/victim.txt")
    attacker.client.put(f"{api}/d/new.txt", content=b"planted")
    client = attacker.client
    client.post(f"/v1/workspaces/{attacker.workspace_id}/suspend").raise_for_status()
    wait_state(client, attacker.workspace_id, "suspended", timeout=120)
    stored = {f["path"] for f in client.get(api).json()["files"]}
    assert "leak.txt" not in stored, stored
    client.post(f"/v1/workspaces/{attacker.workspace_id}/resume").raise_for_status()
    wait_state(client, attacker.workspace_id, "running", timeout=120)
    assert sorted(os.listdir(outside)) == ["victim.txt"], os.listdir(outside)
    assert (field.outside / "victim.txt").read_text() == "keep"
    back = attacker.run(field.cluster, "import json\nprint(json.dumps({'kept': kept}))")
    assert back == {"kept": list(range(10))}
