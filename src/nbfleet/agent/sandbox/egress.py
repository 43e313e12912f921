"""Outbound internet for the kernels of projects that allow it.

A kernel's network namespace has no route by default. For a project in egress
mode the agent (as root) makes a named namespace for the slot, attaches
slirp4netns to it (a user-mode network stack: the kernel's packets become the
agent host's own sockets, and ``--disable-host-loopback`` keeps it off the
host's loopback), and loads nftables rules there that refuse private ranges,
link-local addresses (the cloud metadata service) and IPv6, so only the public
internet is reachable. The sandbox's launcher enters that namespace before
bubblewrap starts; the kernel, without capabilities over it, cannot change it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

#: slirp4netns's DNS forwarder inside the namespace.
DNS = "10.0.2.3"
#: Never reachable: private, shared, loopback, link-local (the metadata service),
#: documentation and benchmark ranges, multicast and reserved; the host's own
#: addresses are added when the agent starts.
REFUSED = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
           "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16",
           "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/3")


def rules(refused: list[str]) -> str:
    return f"""
table inet nbfleet {{
  chain out {{
    type filter hook output priority 0; policy accept;
    oifname "lo" accept
    ip daddr {DNS} udp dport 53 accept
    ip daddr {DNS} tcp dport 53 accept
    ip daddr {{ {", ".join(refused)} }} reject
    meta nfproto ipv6 reject
  }}
}}
"""


def host_addresses() -> list[str]:
    """This host's own IPv4 addresses (the kernels must not reach its services)."""
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                            text=True, timeout=30).stdout
    return sorted({line.split()[3].split("/")[0] for line in listed.splitlines()
                   if len(line.split()) > 3})


class EgressUnavailable(RuntimeError):
    """The agent cannot give kernels internet access here."""


@dataclass
class Netns:
    name: str
    slirp: subprocess.Popen[bytes]
    #: Closing it ends slirp4netns (``--exit-fd``), also when the agent dies.
    lifeline: int

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.lifeline)
        if self.slirp.poll() is None:
            self.slirp.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.slirp.wait(5)
            if self.slirp.poll() is None:
                self.slirp.kill()
                self.slirp.wait()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


def _run(*argv: str, stdin: str | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise OSError(f"{argv[0]} failed: {(result.stderr or result.stdout).strip()[:300]}")


class Egress:
    def __init__(self, prefix: str, resolv_conf: str, refused: list[str]) -> None:
        self.prefix = prefix
        self.rules = rules(refused)
        #: Bound over the sandbox's /etc/resolv.conf: slirp4netns answers DNS.
        self.resolv_conf = resolv_conf

    @classmethod
    def open(cls, state_dir: str, local_id: str) -> Egress:
        """``local_id`` is unique to the agent on this machine: its namespaces' names
        start with a digest of it, and :meth:`sweep` removes only those."""
        if os.geteuid() != 0:
            raise EgressUnavailable("internet access for kernels needs a root agent")
        missing = [tool for tool in ("slirp4netns", "nft", "ip", "nsenter")
                   if shutil.which(tool) is None]
        if missing:
            raise EgressUnavailable(f"internet access for kernels needs {', '.join(missing)}")
        resolv = os.path.join(state_dir, "resolv.conf")
        with open(resolv, "w") as handle:
            handle.write(f"nameserver {DNS}\n")
        os.chmod(resolv, 0o444)
        digest = hashlib.sha256(local_id.encode()).hexdigest()[:8]
        egress = cls(f"nbf{digest}-", resolv,
                     [*REFUSED, *host_addresses()])
        egress.sweep()
        return egress

    def create(self, slot: str) -> Netns:
        """A namespace for ``slot`` with slirp4netns attached and the rules loaded."""
        name = f"{self.prefix}{slot}"[:64]
        _run("ip", "netns", "add", name)
        # slirp4netns ends when the pipe's write end closes: with the namespace, or
        # with the agent if it dies (only the agent holds that end).
        watch, lifeline = os.pipe()
        try:
            slirp = subprocess.Popen(
                ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                 f"--exit-fd={watch}", "--netns-type=path", f"/run/netns/{name}", "tap0"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=(watch,))
        except BaseException:
            os.close(lifeline)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            raise
        finally:
            os.close(watch)
        netns = Netns(name, slirp, lifeline)
        try:
            _run("ip", "netns", "exec", name, "nft", "-f", "-", stdin=self.rules)
            deadline = time.monotonic() + 10
            while not self._routed(name):
                if slirp.poll() is not None or time.monotonic() > deadline:
                    raise OSError("slirp4netns did not configure the namespace")
                time.sleep(0.05)
        except BaseException:
            netns.remove()
            raise
        return netns

    @staticmethod
    def _routed(name: str) -> bool:
        result = subprocess.run(["ip", "netns", "exec", name, "ip", "route", "show", "default"],
                                capture_output=True, text=True, timeout=10)
        return "tap0" in result.stdout

    def sweep(self) -> None:
        """Namespaces a previous boot of this agent left behind."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=30).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(self.prefix):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
