"""LocalAgentProvider against a real control plane: real ``nbfleet agent`` processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from nbfleet.control.fleet.local_agents import LocalAgentProvider
from nbfleet.control.fleet.provider import HostProvider, HostState, ProvisionedHost
from nbfleet.model.errors import DomainError
from tests.support.cluster import Cluster

GPUS = "1xA100-80GB"
#: No warm kernel and no disk quota: these hosts run no workspace.
AGENT_ARGS = ["--warm-pool", "0", "--workspace-disk", "0", "--log-level", "info"]


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane with no agent of its own: the providers bring the hosts."""
    from tests.conftest import fresh_database

    root = tmp_path_factory.mktemp("fleet")
    with fresh_database(root) as url:
        cluster = Cluster(root, url)
        try:
            cluster.start_control()
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
async def make_provider(control: Cluster, tmp_path: Path
                        ) -> AsyncIterator[Callable[..., LocalAgentProvider]]:
    made: list[LocalAgentProvider] = []

    def make(max_hosts: int, base_dir: Path | None = None) -> LocalAgentProvider:
        provider = LocalAgentProvider(control.url, control.secret_file,
                                      base_dir or tmp_path / "fleet", GPUS, max_hosts,
                                      AGENT_ARGS, stop_grace_s=10.0)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.aclose()


async def until(predicate: Callable[[], Any], what: str, timeout: float = 45.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


async def registered(control: Cluster, ids: set[str], timeout: float = 45.0
                     ) -> dict[str, dict[str, Any]]:
    """The control plane's records of the agents ``ids``, once all have registered."""
    headers = {"Authorization": f"Bearer {control.admin_token}"}
    async with httpx.AsyncClient(base_url=control.url, headers=headers) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            items = (await client.get("/v1/admin/agents")).json()["items"]
            found = {a["id"]: a for a in items if a["id"] in ids}
            if len(found) == len(ids):
                return found
            await asyncio.sleep(0.2)
    raise TimeoutError(f"agents {sorted(ids)} did not all register")


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def running_under(directory: Path) -> list[int]:
    """Processes whose command line names ``directory`` (agents of that provider)."""
    pids = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if str(directory) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            pids.append(proc.pid)
    return pids


def pid_of(provider: LocalAgentProvider, agent_id: str) -> int:
    pid = provider.pid_of(agent_id)
    assert pid is not None
    return pid


def states(provider: LocalAgentProvider) -> dict[str, HostState]:
    return {h.agent_id: h.state for h in provider.hosts()}


async def test_provision_register_release_and_close(
        control: Cluster, make_provider: Callable[..., LocalAgentProvider],
        tmp_path: Path) -> None:
    provider = make_provider(max_hosts=2)
    assert isinstance(provider, HostProvider)

    started = await provider.provision(3)  # one more than max_hosts allows
    assert len(started) == 2
    assert all(h.state is HostState.STARTING for h in started)
    assert await provider.provision(1) == []  # full
    ids = {h.agent_id for h in started}
    assert len(ids) == 2 and len({h.handle for h in started}) == 2
    pids = {h.agent_id: pid_of(provider, h.agent_id) for h in started}

    # The ids were fixed before the agents started, and they register under them.
    records = await registered(control, ids)
    for host in started:
        record = records[host.agent_id]
        assert record["url"] == host.url
        assert record["inventory"]["gpus"] == [{"count": 1, "type": "A100-80GB",
                                                "vram_gb": 80}]
    await until(lambda: set(states(provider).values()) == {HostState.RUNNING}, "running")

    secret = control.secret.encode()
    for host in started:
        pid = pids[host.agent_id]
        assert alive(pid)
        state_dir = provider.state_dir_of(host.agent_id)
        assert state_dir is not None and state_dir.parent == tmp_path / "fleet" / "hosts"
        assert (state_dir / "agent-id").read_text() == host.agent_id
        assert (state_dir / "agent.log").stat().st_mode & 0o077 == 0
        assert b"registered as" in (state_dir / "agent.log").read_bytes()
        # The secret is in a file; neither the command line nor the environment has it.
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret not in Path(f"/proc/{pid}/environ").read_bytes()

    first, second = sorted(ids)
    await provider.release(first)
    assert not alive(pids[first])
    assert alive(pids[second])
    assert states(provider) == {second: HostState.RUNNING}
    await provider.release(first)  # idempotent
    await provider.release("host_unknown")

    # The released host's place is free again; the new host gets a new id.
    [third] = await provider.provision(1)
    assert third.agent_id not in ids
    assert await provider.provision(1) == []

    # aclose stops everything, also a host still starting.
    third_pid = pid_of(provider, third.agent_id)
    await provider.aclose()
    assert provider.hosts() == []
    assert not alive(pids[second]) and not alive(third_pid)
    assert running_under(tmp_path / "fleet") == []
    with pytest.raises(RuntimeError):
        await provider.provision(1)


async def test_a_host_that_dies_shows_as_gone(
        control: Cluster, make_provider: Callable[..., LocalAgentProvider],
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    provider = make_provider(max_hosts=1)
    # Concurrent calls share max_hosts: only one of them starts a host.
    answers = await asyncio.gather(provider.provision(1), provider.provision(1))
    [host] = [h for answer in answers for h in answer]
    await registered(control, {host.agent_id})
    pid = pid_of(provider, host.agent_id)
    os.kill(pid, signal.SIGKILL)

    gone: list[ProvisionedHost] = await until(
        lambda: [h for h in provider.hosts() if h.state is HostState.GONE], "gone")
    assert gone[0].agent_id == host.agent_id
    assert gone[0].detail == "killed by SIGKILL"
    assert not alive(pid)

    # A gone host holds no place, and is listed until it is released.
    [replacement] = await provider.provision(1)
    assert states(provider) == {host.agent_id: HostState.GONE,
                                replacement.agent_id: HostState.STARTING}
    await provider.release(host.agent_id)
    assert [h.agent_id for h in provider.hosts()] == [replacement.agent_id]

    # With no grace at all, release kills the agent's process group at once.
    await until(lambda: states(provider) == {replacement.agent_id: HostState.RUNNING},
                "running")
    replacement_pid = pid_of(provider, replacement.agent_id)
    provider.stop_grace_s = 0.0
    with caplog.at_level(logging.WARNING, "nbfleet.control.fleet.local_agents"):
        await provider.aclose()
    assert "killing it" in caplog.text
    assert not alive(replacement_pid)
    assert running_under(tmp_path / "fleet") == []


async def test_a_new_provider_kills_the_agent_an_old_one_left(
        control: Cluster, make_provider: Callable[..., LocalAgentProvider],
        tmp_path: Path) -> None:
    """A provider that died without aclose (kill -9 of `nbfleet up`) leaves its
    agents; the next one on the same base_dir reuses their ids, so it kills them."""
    crashed = make_provider(max_hosts=1)
    [old] = await crashed.provision(1)
    await until(lambda: states(crashed) == {old.agent_id: HostState.RUNNING}, "running")
    old_pid = pid_of(crashed, old.agent_id)

    fresh = make_provider(max_hosts=1)
    [new] = await fresh.provision(1)
    assert new.agent_id == old.agent_id  # deterministic: base_dir and index
    assert not alive(old_pid)
    await until(lambda: states(fresh) == {new.agent_id: HostState.RUNNING}, "running")
    await fresh.aclose()
    await crashed.aclose()
    assert running_under(tmp_path / "fleet") == []


async def test_limits_and_options(control: Cluster, tmp_path: Path) -> None:
    def make(max_hosts: int = 1, gpus: str = GPUS,
             agent_args: tuple[str, ...] = ()) -> LocalAgentProvider:
        return LocalAgentProvider(control.url, control.secret_file, tmp_path / "fleet",
                                  gpus, max_hosts, agent_args)

    with pytest.raises(ValueError, match="--port"):
        make(agent_args=("--port=9000",))
    with pytest.raises(ValueError, match="--secret-file"):
        make(agent_args=("--secret-file", "/tmp/x"))
    with pytest.raises(DomainError):
        make(gpus="lots of GPUs")
    with pytest.raises(ValueError):
        make(max_hosts=-1)

    async with make(max_hosts=0) as provider:
        assert await provider.provision(2) == []
        with pytest.raises(ValueError):
            await provider.provision(-1)
        assert provider.hosts() == []
    assert running_under(tmp_path / "fleet") == []

    missing = LocalAgentProvider(control.url, tmp_path / "no-secret", tmp_path / "fleet",
                                 GPUS, 1)
    with pytest.raises(FileNotFoundError):
        await missing.provision(1)
    await missing.aclose()
