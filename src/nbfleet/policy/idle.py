"""When is a workspace idle enough to suspend?

Idle means no cell running, no client connected, and no kernel activity for the
timeout. "No output" is not idle: a long training loop can be silent for hours, and
culling it is the classic complaint about JupyterHub's culler (it goes by last
activity alone). Here a kernel whose status is anything but ``idle`` (busy,
starting, restarting) keeps its workspace alive however quiet it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Kernel states in which nothing runs. A dead kernel runs nothing either.
RESTING = frozenset({"idle", "dead"})


@dataclass(frozen=True, slots=True)
class KernelActivity:
    execution_state: str
    connections: int
    #: Seconds since the kernel last sent or received a message (on its host's clock).
    idle_s: float


def idle_seconds(kernels: Sequence[KernelActivity], running_s: float) -> float | None:
    """How long the workspace has been idle; None while anything is going on.

    ``running_s`` is how long it has been running: a workspace is never idler than
    that, and one without kernels is idle from the moment it started.
    """
    if any(k.execution_state not in RESTING or k.connections > 0 for k in kernels):
        return None
    return min([running_s, *(k.idle_s for k in kernels)])


def should_suspend(kernels: Sequence[KernelActivity], running_s: float,
                   timeout_s: float) -> bool:
    if timeout_s <= 0:
        return False
    idle = idle_seconds(kernels, running_s)
    return idle is not None and idle >= timeout_s
