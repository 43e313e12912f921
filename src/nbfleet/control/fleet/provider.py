"""Hosts on demand: the interface a cloud plugs into.

The autoscaler (``policy/scheduling/autoscaler.py``) is a pure policy: it answers
``ScaleOut(count, reason)`` and ``ScaleIn(host_ids)``. A :class:`HostProvider` is
what carries those answers out. Its contract, which every implementation keeps:

* **Provisioning is asynchronous.** ``provision(count)`` asks for hosts and
  returns their handles at once (``starting``); it does not wait for them to
  boot. A host joins the fleet when its agent registers with the control plane
  (``POST /internal/agents``), exactly like a host an operator started by hand.
* **Hosts identify themselves by agent id.** Each handle carries the agent id its
  host will register under, fixed by the provider before the host boots, so the
  control plane can match a registration to the request that caused it and count
  hosts that are asked for but not registered yet (and not ask twice).
* **Release is idempotent.** ``release(agent_id)`` stops the host and forgets it;
  releasing an unknown, already released or dead host does nothing. Two
  concurrent releases of one host wait for the same stop.
* **The control plane never releases a host with work on it.** On ``ScaleIn`` it
  first stops placing work there and waits until the host holds no runtimes,
  kernels or job attempts, and only then calls ``release``. The provider does not
  check: it kills what is there.
* ``hosts()`` is the provider's own view: every host it started and has not
  released. One that died on its own stays listed as ``gone`` (with the reason)
  until it is released, so the control plane learns about it; ``gone`` hosts do
  not count against ``max_hosts``.

A cloud implements it with its own API, for example:

* **EC2**: ``provision`` calls ``RunInstances`` (a launch template whose user data
  runs ``nbfleet agent``) and writes the agent id it chose into the instance's
  user data or tags, where the agent reads it into its state directory's
  ``agent-id`` before starting; the handle is the instance id. ``release`` calls
  ``TerminateInstances`` (already terminated is fine). ``hosts`` maps
  ``pending/running/shutting-down/terminated`` onto the four states.
* **GCE**: the same with instance templates and metadata; **Kubernetes**: a pod
  (or a StatefulSet replica, whose ordinal gives the id) per host, deleted on
  release.

:class:`~nbfleet.control.fleet.local_agents.LocalAgentProvider`
(``control/fleet/local_agents.py``) is the real implementation for one machine:
each host is an ``nbfleet agent`` child process with its own state directory and
port (``nbfleet up --max-hosts N``). See ``docs/fleet-provider.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable


class HostState(enum.StrEnum):
    STARTING = "starting"  #: asked for; not answering yet
    RUNNING = "running"  #: up (for local agents: registered and answering)
    STOPPING = "stopping"  #: being released
    GONE = "gone"  #: stopped, or died on its own (``detail`` says how)


#: States that hold a place under ``max_hosts``.
ACTIVE = frozenset({HostState.STARTING, HostState.RUNNING, HostState.STOPPING})


@dataclass(frozen=True, slots=True)
class ProvisionedHost:
    """A snapshot of one host a provider started."""

    #: The provider's own name for it (an instance id, a pod name, ``local-3``).
    handle: str
    #: The id its agent registers under; the control plane matches on it.
    agent_id: str
    state: HostState
    started_at: datetime
    #: Where its agent listens, when the provider knows before registration.
    url: str | None = None
    #: Why it is ``gone`` (an exit status), or empty.
    detail: str = ""


@runtime_checkable
class HostProvider(Protocol):
    """Starts and stops hosts for the control plane (see the module docstring)."""

    @property
    def max_hosts(self) -> int:
        """The most hosts it keeps at once (``starting``, ``running`` or ``stopping``)."""
        ...

    async def provision(self, count: int) -> list[ProvisionedHost]:
        """Ask for ``count`` more hosts; returns their handles without waiting for them.

        Returns fewer (and logs why) where ``max_hosts`` leaves less room.
        """
        ...

    async def release(self, host_id: str) -> None:
        """Stop the host whose agent id is ``host_id`` and forget it; idempotent.

        Called only once the control plane has emptied the host.
        """
        ...

    def hosts(self) -> list[ProvisionedHost]:
        """Every host started and not yet released, dead ones as ``gone``."""
        ...

    async def aclose(self) -> None:
        """Stop every host this provider started; it provisions nothing after."""
        ...
