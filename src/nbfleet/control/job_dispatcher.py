"""The job dispatcher: one replica at a time places queued jobs and watches attempts.

Under the ``job-dispatcher`` lease (with its fencing token checked in every
transaction that writes) a pass:

1. reads the live fleet and the heads of the queue, asks ``policy.job_dispatch``
   for starts and preemptions, claims the starts in one transaction and calls the
   agents (a failed call ends the attempt as ``launch_failed``, an infrastructure
   failure that retries elsewhere);
2. re-sends start orders for attempts scheduled but never confirmed;
3. ends attempts whose host restarted (a new boot id), and attempts silent for
   ``heartbeat_timeout_s`` (lost workers); the latter only once this replica has
   held the lease that long itself, so a control plane that was down for a while
   does not take its own silence for its agents' deaths;
4. now and then deletes results past their retention.

It wakes on a submission or a finish in this process, on PostgreSQL's NOTIFY
from any replica, and otherwise every ``job_dispatch_interval_s``. A wake-up runs
step 1 only (and the agent calls it decided): the lease renewal and steps 2 to 4
run at most once per interval, so a burst of submissions, each waking the
dispatcher, costs one cheap pass per wake-up instead of the whole tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
import time
from datetime import timedelta

from sqlalchemy.orm import Session

from nbfleet.control import leases
from nbfleet.control.platform import Platform
from nbfleet.jobs import attempts, dispatch, results
from nbfleet.jobs.admission import CHANNEL
from nbfleet.jobs.dispatch import StartOrder, StopOrder
from nbfleet.model.errors import DomainError
from nbfleet.model.jobs import Outcome
from nbfleet.policy.job_dispatch import can_act, plan_dispatch
from nbfleet.web.metrics import JOB_DISPATCH

log = logging.getLogger(__name__)

LEASE = "job-dispatcher"
#: Queue heads read per (tier, tenant) and pass, at most.
MAX_HEADS = 500
RETENTION_EVERY_S = 30.0


class LeaseLost(Exception):
    """Another replica holds the dispatcher lease now: stop writing."""


class JobDispatcher:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.db = platform.db
        self.settings = platform.jobs
        self.token: int | None = None
        self.leader_since: float | None = None
        self._last_retention = 0.0
        #: When the lease was last renewed and steps 2-3 last ran (monotonic clock).
        self._last_periodic = -math.inf
        self._stop_listening = threading.Event()

    # ----------------------------------------------------------------- loop
    async def run_forever(self) -> None:
        wake = self.platform.bind_jobs_loop()
        listener = self._listen(asyncio.get_running_loop(), wake)
        try:
            while True:
                wake.clear()
                try:
                    await self.tick()
                except LeaseLost:
                    self.token = self.leader_since = None
                except Exception:
                    log.exception("job dispatch pass failed")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.platform.config.job_dispatch_interval_s):
                        await wake.wait()
        finally:
            self._stop_listening.set()
            if listener is not None:
                await asyncio.to_thread(listener.join, 5)

    def _listen(self, loop: asyncio.AbstractEventLoop,
                wake: asyncio.Event) -> threading.Thread | None:
        """LISTEN on PostgreSQL in a thread; each NOTIFY wakes the loop."""
        if self.db.is_sqlite:
            return None
        url = self.db.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)

        def run() -> None:
            import psycopg

            while not self._stop_listening.is_set():
                try:
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute(f"LISTEN {CHANNEL}")
                        while not self._stop_listening.is_set():
                            for _ in conn.notifies(timeout=0.5, stop_after=1):
                                loop.call_soon_threadsafe(wake.set)
                except Exception as exc:  # the DB restarting, say: listen again
                    log.warning("job notification listener: %s", exc)
                    self._stop_listening.wait(1.0)

        thread = threading.Thread(target=run, name="job-notify", daemon=True)
        thread.start()
        return thread

    async def tick(self) -> None:
        """One dispatch pass; once per interval also the lease renewal, re-sent
        start orders, the lost-worker sweep and (rarely) the retention purge. A
        pass between renewals is safe: every write it makes checks the fencing
        token, and the lease outlives two intervals."""
        interval = self.platform.config.job_dispatch_interval_s
        periodic = self.token is None or time.monotonic() - self._last_periodic >= interval
        if periodic:
            self.token = await asyncio.to_thread(
                leases.acquire, self.db, LEASE, self.platform.instance_id,
                max(self.platform.config.lease_ttl_s, 2 * interval))
            if self.token is None:
                self.leader_since = None
                return
            self._last_periodic = time.monotonic()
            if self.leader_since is None:
                self.leader_since = time.monotonic()
        starts, stops = await asyncio.to_thread(self.dispatch_pass)
        # The agent calls first: a start waits for nothing but its claim.
        await asyncio.gather(*(self._start(order) for order in starts),
                             *(self._stop(order) for order in stops))
        if not periodic:
            return
        resent = await asyncio.to_thread(self._resend)
        await asyncio.gather(*(self._start(order) for order in resent))
        await asyncio.to_thread(self.sweep)
        if time.monotonic() - self._last_retention > RETENTION_EVERY_S:
            self._last_retention = time.monotonic()
            await asyncio.to_thread(self.purge_results)

    def _check_lease(self, session: Session) -> None:
        if self.token is None or not leases.still_held(session, LEASE, self.token):
            raise LeaseLost()

    # ------------------------------------------------------------- dispatch
    def dispatch_pass(self) -> tuple[list[StartOrder], list[StopOrder]]:
        """Plan and claim one pass (blocking); returns the agent calls to make."""
        with self.db.transaction(write=False) as session:
            now = self.db.now(session)
            fleet = dispatch.load_fleet(session, now, self.platform.config.agent_timeout_s)
            if not can_act(fleet.free, fleet.placed):
                return [], []  # the queue's heads could not change the plan: skip them
            heads = max(1, min(MAX_HEADS, fleet.free.free_count()))
            pending = dispatch.load_queue(session, now, heads)
            if not pending:
                return [], []
            tenant_ids = {job.work.tenant_id for job in pending} | {
                p.work.tenant_id for p in fleet.placed}
            tenants = dispatch.load_tenants(session, tenant_ids)
            usage = dispatch.load_usage(session, tenant_ids, self.settings.usage_half_life_s)
        plan = plan_dispatch(pending, fleet.free, tenants, usage, fleet.placed,
                             now.timestamp())
        with self.db.transaction() as session:
            orders = dispatch.claim(session, plan.starts, fleet, self.settings,
                                    self.db.now(session), self._check_lease)
        stops: list[StopOrder] = []
        for job, victims in plan.preemptions:
            with self.db.transaction() as session:
                stops += dispatch.request_preemption(session, victims, job.work.id, fleet,
                                                     self.settings, self.db.now(session),
                                                     self._check_lease)
        JOB_DISPATCH.labels("start").inc(len(orders))
        JOB_DISPATCH.labels("preempt").inc(len(stops))
        return orders, stops

    def _resend(self) -> list[StartOrder]:
        with self.db.transaction(write=False) as session:
            return dispatch.resend_orders(
                session, self.settings, self.db.now(session),
                after_s=max(2.0, self.settings.heartbeat_timeout_s / 3),
                agent_timeout_s=self.platform.config.agent_timeout_s)

    async def _start(self, order: StartOrder) -> None:
        try:
            reply = await self.platform.agents.start_job(order.host.url, order.body)
        except DomainError as exc:
            log.warning("could not start %s#%d on %s: %s", order.job_id, order.attempt,
                        order.host.id, exc.detail)
            await asyncio.to_thread(self._end, order.job_id, order.attempt,
                                    Outcome.LAUNCH_FAILED, f"agent {order.host.id}: {exc.detail}")
            return
        if reply.state == "running":
            await asyncio.to_thread(self._started, order)

    async def _stop(self, order: StopOrder) -> None:
        """Best effort: the heartbeat's directives repeat it until the agent obeys."""
        with contextlib.suppress(DomainError):
            await self.platform.agents.stop_job(order.host_url, order.job_id, order.attempt,
                                                order.reason, order.grace_s)

    def _started(self, order: StartOrder) -> None:
        with self.db.transaction() as session:
            attempts.started(session, order.job_id, order.attempt, self.db.now(session))

    def _end(self, job_id: str, attempt: int, outcome: Outcome, detail: str,
             silent: bool = False) -> bool:
        with self.db.transaction() as session:
            self._check_lease(session)
            now = self.db.now(session)
            cutoff = None
            if silent:
                cutoff = now - timedelta(seconds=self.settings.heartbeat_timeout_s)
            ended = attempts.end_if_live(session, job_id, attempt, outcome, detail,
                                         self.settings, now, random.random(), older_than=cutoff)
        if ended:
            self.platform.wake_jobs()
        return ended

    # ---------------------------------------------------------------- sweep
    def sweep(self) -> int:
        """End attempts of restarted hosts, and (after the grace) silent ones."""
        with self.db.transaction(write=False) as session:
            restarted = attempts.attempts_on_old_boots(session)
            silent: list[tuple[str, int]] = []
            if self.leader_since is not None and \
                    time.monotonic() - self.leader_since >= self.settings.heartbeat_timeout_s:
                silent = attempts.silent_attempts(session, self.db.now(session),
                                                  self.settings.heartbeat_timeout_s)
        ended = 0
        for job_id, attempt in restarted:
            ended += self._end(job_id, attempt, Outcome.LOST, "its host restarted")
        for job_id, attempt in silent:
            ended += self._end(job_id, attempt, Outcome.LOST,
                               f"no heartbeat for {self.settings.heartbeat_timeout_s:g} s",
                               silent=True)
        if ended:
            log.warning("ended %d attempts lost with their hosts", ended)
        return ended

    def purge_results(self) -> int:
        return results.purge(self.db, self.platform.blobs)
