"""Warm containers on a host, as the policy's ``Prewarm`` asks.

The policy counts containers as *warming* until it is told they are ready, as the
simulator tells it after a start; the live side grows the agent's warm pool to
the policy's figure for the host and waits for the agent to report them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from nbfleet.model.errors import DomainError, Unavailable

if TYPE_CHECKING:
    from nbfleet.control.platform import Platform

log = logging.getLogger(__name__)

#: How long a prewarm may take before the scheduler stops waiting for it (the
#: host then keeps counting those containers as warming, and is not asked again).
PREWARM_TIMEOUT_S = 300.0


async def warm_pool_ready(platform: Platform, host_id: str, url: str | None,
                          target: int) -> bool:
    """Grow the host's warm pool to ``target`` and wait until that many are ready;
    False (logged) when the host cannot be asked or does not get there in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PREWARM_TIMEOUT_S
    try:
        if url is None:
            raise Unavailable(f"no address known for host {host_id}")
        state = await platform.agents.warm_pool(url, target)
        while state.ready < target:
            if loop.time() > deadline:
                log.warning("host %s did not warm %d containers within %.0f s",
                            host_id, target, PREWARM_TIMEOUT_S)
                return False
            await asyncio.sleep(0.25)
            state = await platform.agents.warm_pool(url)
    except DomainError as exc:
        log.warning("growing the warm pool of %s to %d failed: %s", host_id, target, exc)
        return False
    return True
