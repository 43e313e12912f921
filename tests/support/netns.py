"""Hosts in network namespaces: an agent each, as on machines of their own.

Each host is a network namespace joined to this one by a veth pair: the agent
listens on its own address there and reaches the control plane and the S3 server
only across that link, at the host side's address (the gateway), as a separate
machine would across a network. Cutting the link (:meth:`NetHost.cut`) is a
network partition: the agent keeps running but nothing reaches it.

Needs root and iproute2 (``ip netns``); :func:`unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class NetHost:
    #: The namespace's name (``ip netns``).
    namespace: str
    #: The veth end in this (the root) namespace.
    link: str
    #: The agent's address, inside the namespace.
    address: str
    #: This namespace's address on the link: where the host reaches the others.
    gateway: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """A partition: the link goes down, the processes behind it keep running."""
        _ip("link", "set", self.link, "down")


def heal(host: NetHost) -> None:
    """The link up again after :meth:`NetHost.cut`."""
    _ip("link", "set", host.link, "up")


def unavailable() -> str | None:
    """Why hosts in network namespaces cannot be made here; None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"nbfprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    argv = ["ip", *(("-n", namespace) if namespace else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


@contextlib.contextmanager
def net_hosts(count: int) -> Iterator[list[NetHost]]:
    """``count`` namespaces, each on a /30 of its own in a random 10.x.y.0/24 (two
    test runs at once pick different ones), removed when the block ends."""
    tag = secrets.token_hex(3)
    subnet = f"10.{secrets.choice(range(200, 250))}.{secrets.randbelow(256)}"
    hosts: list[NetHost] = []
    try:
        for index in range(count):
            base = 4 * index
            host = NetHost(f"nbf{tag}{index}", f"nbh{tag}{index}", f"{subnet}.{base + 2}",
                           f"{subnet}.{base + 1}")
            inside = f"nbn{tag}{index}"
            _ip("netns", "add", host.namespace)
            hosts.append(host)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.namespace)
            _ip("addr", "add", f"{host.gateway}/30", "dev", host.link)
            _ip("link", "set", host.link, "up")
            _ip("addr", "add", f"{host.address}/30", "dev", inside, namespace=host.namespace)
            _ip("link", "set", inside, "up", namespace=host.namespace)
            _ip("link", "set", "lo", "up", namespace=host.namespace)
        yield hosts
    finally:
        for host in hosts:
            with contextlib.suppress(RuntimeError):
                _ip("link", "del", host.link)  # takes its peer with it
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", host.namespace)
