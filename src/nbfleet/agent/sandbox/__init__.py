"""Isolation for user code: namespaces, seccomp, uids, cgroups and disk quotas."""

from __future__ import annotations

from nbfleet.agent.sandbox.command import Sandbox, unseen
from nbfleet.agent.sandbox.devices import gpu_paths
from nbfleet.agent.sandbox.isolation import (
    MODES,
    Isolation,
    SandboxUnavailable,
    open_isolation,
    python_paths,
)

__all__ = ["MODES", "Isolation", "Sandbox", "SandboxUnavailable", "gpu_devices",
           "open_isolation", "python_paths", "unseen"]


def gpu_devices() -> list[str]:
    """NVIDIA's device nodes on this host (none on a machine without GPUs), in
    ``$NBFLEET_GPU_DEVICE_DIR`` instead of /dev where it is set (``devices.py``)."""
    return gpu_paths()
