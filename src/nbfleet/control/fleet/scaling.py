"""Scale-out and scale-in, carried out through a :class:`HostProvider`.

The policy decides (``ScaleOut``, ``ScaleIn``); this class makes it so. A
scale-out asks the provider for hosts, which join when their agents register. A
scale-in first empties the host: every workspace on it is moved with its state
to a host the policy still has (or suspended, when there is none), and only when
no runtime is left there is the host released. The policy already dropped the
host from its model; ``draining`` keeps it out until it is gone, so the next sync
does not add it back.

The policy counts hosts it asked for as ``provisioning``. The provider's own list
is the truth about them, so each pass sets that count from it: a host that failed
to start, or that the provider could not start (its ``max_hosts``), stops being
waited for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable, Set
from typing import TYPE_CHECKING, Any

from nbfleet.control.fleet.provider import HostProvider, HostState
from nbfleet.control.fleet.scheduler import LiveScheduler

if TYPE_CHECKING:
    from nbfleet.control.platform import Platform

log = logging.getLogger(__name__)

#: How long a drain may take before the host is released anyway (its workspaces
#: are then placed again from their last saved state, as after a lost host).
DRAIN_TIMEOUT_S = 600.0


class Scaler:
    def __init__(self, platform: Platform, provider: HostProvider | None) -> None:
        self.platform = platform
        self.provider = provider
        self.draining: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def owns(self, host_id: str) -> bool:
        return self.provider is not None and any(
            h.agent_id == host_id for h in self.provider.hosts())

    def static_hosts(self, host_ids: Iterable[str], leaving: Set[str] = frozenset()) -> int:
        """How many of these hosts the autoscaler can never stop: those its provider
        did not start, less those on their way out (``leaving``, or released by this
        scaler). A released host stays registered until its heartbeats lapse; counted
        as someone else's, it raised the floor to the fleet's peak, and the
        autoscaler scaled out again the moment it had scaled in."""
        return sum(1 for host_id in host_ids
                   if host_id not in self.draining and host_id not in leaving
                   and not self.owns(host_id))

    def scale_out(self, count: int, reason: str) -> None:
        if self.provider is None:
            log.info("scale-out of %d hosts decided (%s); no host provider is configured",
                     count, reason)
            return
        log.info("scaling out by %d hosts: %s", count, reason)
        self._spawn(self._provision(count))

    def scale_in(self, host_ids: tuple[str, ...]) -> None:
        for host_id in host_ids:
            if not self.owns(host_id):
                log.info("scale-in of %s decided, but the provider did not start it: it "
                         "stays, and rejoins the model", host_id)
                continue
            self.draining.add(host_id)
            self._spawn(self._drain(host_id))

    def settle_provisioning(self, scheduler: LiveScheduler) -> None:
        """Count as provisioning exactly the provider's hosts that are starting."""
        if self.provider is None:
            scheduler.policy.provisioning = 0
            return
        starting = [h for h in self.provider.hosts() if h.state in
                    (HostState.STARTING, HostState.RUNNING)
                    and h.agent_id not in scheduler.policy.hosts
                    and h.agent_id not in self.draining]
        scheduler.policy.provisioning = len(starting)

    def forget_gone(self, alive: set[str]) -> None:
        """Hosts that finished draining and stopped heartbeating may come back."""
        self.draining &= alive

    async def _provision(self, count: int) -> None:
        assert self.provider is not None
        try:
            started = await self.provider.provision(count)
        except Exception:
            log.exception("provisioning %d hosts failed", count)
            return
        log.info("provisioning %s", [h.agent_id for h in started])

    async def _drain(self, host_id: str) -> None:
        assert self.provider is not None
        deadline = asyncio.get_running_loop().time() + DRAIN_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            fleet = self.platform.fleet
            left = await fleet.send_away(host_id, fleet.scheduler)
            if left is None:
                log.info("no longer in charge: host %s is left to the replica that is",
                         host_id)
                return
            if left == 0:
                break
            await asyncio.sleep(0.5)
        else:
            log.warning("host %s did not empty within %.0f s; releasing it anyway",
                        host_id, DRAIN_TIMEOUT_S)
        await self.provider.release(host_id)
        log.info("host %s released", host_id)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.provider is not None:
            await self.provider.aclose()

