"""The host provider a control plane builds from its own settings."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from nbfleet.control.fleet.provider import HostProvider, LocalAgentProvider

if TYPE_CHECKING:
    from nbfleet.control.platform import ControlConfig


def local_provider(config: ControlConfig) -> HostProvider | None:
    """Local agent processes when the autoscaler may add hosts (``--max-hosts`` with
    ``--host-gpus``); None otherwise. The agents read the cluster secret from a
    0600 file in the hosts' directory (never a command line), and their kernels
    see nothing of the control plane's home."""
    if not (config.max_hosts and config.host_gpus and config.control_url and config.home_dir):
        return None
    hosts_dir = Path(config.home_dir) / "hosts"
    hosts_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    secret_file = hosts_dir / "cluster-secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(config.secret + "\n")
    return LocalAgentProvider(config.control_url, secret_file, hosts_dir, config.host_gpus,
                              config.max_hosts, home=config.home_dir,
                              agent_args=shlex.split(config.host_agent_args))
