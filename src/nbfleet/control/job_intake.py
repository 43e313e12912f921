"""Job submissions admitted in batches: group commit for ``POST /v1/jobs``.

A submission's database work is some twenty statements (the token, the
idempotency key, the project, the binary, the quarantine, the wallet's buckets,
the spend counters, the hold, its parts, journal and audit rows, the job and its
event). One transaction per submission makes a control-plane process spend
nearly all its time on round trips and per-statement overhead. Instead, requests
wait in a queue, and one thread takes everything that is waiting (up to
``max_batch``) and admits it in one transaction, with one statement per kind of
row for the whole batch. Nothing waits on a timer: a lone request is admitted at
once, and under load the batch is whatever arrived while the last one ran, so
latency stays one transaction while throughput grows with the load.

Each request still gets exactly its own answer:

* the batch is judged in arrival order, as if the requests had come one after
  the other (``admission.admit``): a refused request (an unknown binary, a
  budget, too little credit) leaves nothing behind and does not disturb the
  others;
* its token is checked, and its ``Idempotency-Key`` claimed and its outcome
  stored, in the same transaction as its job, so a retry replays it, and a crash
  leaves either everything or nothing;
* if the batch's transaction fails as a whole (a lost connection, a deadlock, a
  bug), each request is tried again alone, so one bad request cannot fail others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import auth, idempotency
from nbfleet.control.platform import Platform
from nbfleet.db.queries import among
from nbfleet.db.tables import Project
from nbfleet.jobs import admission
from nbfleet.jobs.views import job_view
from nbfleet.ledger import audit
from nbfleet.model.errors import DomainError, NotFound, Unauthorized
from nbfleet.web.metrics import JOB_INTAKE_BATCH

log = logging.getLogger(__name__)

#: Submissions admitted in one transaction, at most.
MAX_BATCH = 64
#: After a batch of at least LINGER_AFTER submissions, the next one waits LINGER_S
#: for more to arrive (a lone submission never waits).
LINGER_AFTER = 8
LINGER_S = 0.003
#: How long the fleet's host shapes (what admission checks a job could ever run
#: on) are reused before they are read again.
SHAPES_TTL_S = 5.0

Outcome = idempotency.Outcome


@dataclass
class Submission:
    """One ``POST /v1/jobs`` as the route parsed it, waiting for its answer."""

    token: str | None
    idempotency_key: str | None
    #: The request's fingerprint, which its Idempotency-Key is bound to.
    fingerprint: str
    #: The project the body names, if any: it must be the caller's.
    project: str | None
    request: admission.JobRequest
    request_id: str | None = None
    answer: concurrent.futures.Future[Reply] = field(
        default_factory=concurrent.futures.Future)


@dataclass(frozen=True, slots=True)
class Reply:
    """The outcome to send (a status and body, stored under the key if there is
    one), or an error that is not stored (a bad token, a key in use)."""

    outcome: Outcome | None = None
    error: DomainError | None = None
    replayed: bool = False


class JobIntake:
    """The queue and the one thread that admits what waits in it."""

    def __init__(self, platform: Platform, max_batch: int = MAX_BATCH) -> None:
        self.platform = platform
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[Submission | None] = queue.SimpleQueue()
        #: One admitting thread: a second (so one batch's Python overlaps the
        #: other's round trips) measured slower, with batches half as large.
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._shapes: tuple[float, list[admission.Shape]] | None = None
        self._last_size = 0

    async def submit(self, submission: Submission) -> Reply:
        """Queue a submission and wait for its reply."""
        self._start()
        self._queue.put(submission)
        return await asyncio.wrap_future(submission.answer)

    def close(self) -> None:
        """Admit what is queued, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(30)

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="job-intake",
                                                    daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, stop = self._next_batch()
            if batch:
                self.admit(batch)

    def _next_batch(self) -> tuple[list[Submission], bool]:
        """What waits (blocking for the first), less submissions whose caller gave
        up before their turn; and whether to stop after it."""
        first = self._queue.get()
        if first is None:
            return [], True
        if self._last_size >= LINGER_AFTER:
            # Under load, like PostgreSQL's commit_delay: let the event loop queue a
            # few more requests, so each transaction's fixed cost is shared wider.
            time.sleep(LINGER_S)
        waiting, stop = [first], False
        while len(waiting) < self.max_batch:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                stop = True
                break
            waiting.append(more)
        batch = [item for item in waiting if item.answer.set_running_or_notify_cancel()]
        self._last_size = len(batch)
        return batch, stop

    # ------------------------------------------------------------- a batch
    def admit(self, batch: Sequence[Submission]) -> None:
        """Answer every submission of the batch (blocking). Never raises: the
        thread must outlive any failure, or every later submission would hang."""
        JOB_INTAKE_BATCH.observe(len(batch))
        try:
            replies = self._in_one_transaction(batch)
        except Exception as exc:
            if len(batch) > 1:
                log.warning("a batch of %d job submissions failed (%s); admitting each alone",
                            len(batch), exc)
                for submission in batch:
                    self.admit([submission])
            else:
                log.exception("a job submission failed")
                batch[0].answer.set_exception(exc)
            return
        try:
            if any(reply.outcome is not None and reply.outcome[0] == 202
                   and not reply.replayed for reply in replies):
                self.platform.wake_jobs()
        finally:
            for submission, reply in zip(batch, replies, strict=True):
                submission.answer.set_result(reply)

    def _in_one_transaction(self, batch: Sequence[Submission]) -> list[Reply]:
        db = self.platform.db
        with db.transaction() as session:
            now = db.now(session)
            replies: list[Reply | None] = [None] * len(batch)
            principals = auth.resolve_many(session, {s.token for s in batch if s.token})
            callers: dict[int, auth.Principal] = {}
            for index, submission in enumerate(batch):
                principal = principals.get(submission.token or "")
                if principal is None:
                    replies[index] = Reply(error=Unauthorized(
                        auth.INVALID if submission.token else auth.MISSING))
                else:
                    callers[index] = principal
            keyed = [index for index in callers if batch[index].idempotency_key is not None]
            claims = idempotency.claim_many(session, [
                (callers[index].user_id, batch[index].idempotency_key or "",
                 batch[index].fingerprint) for index in keyed], now)
            for index, claim in zip(keyed, claims, strict=True):
                if isinstance(claim, DomainError):
                    replies[index] = Reply(error=claim)
                elif claim is not None:
                    replies[index] = Reply(outcome=claim, replayed=True)
            to_run = [index for index in callers if replies[index] is None]
            outcomes = self._admit(session, [batch[i] for i in to_run],
                                   [callers[i] for i in to_run], now)
            stored: list[tuple[str, str, Outcome]] = []
            for index, outcome in zip(to_run, outcomes, strict=True):
                replies[index] = Reply(outcome=outcome)
                key = batch[index].idempotency_key
                if key is not None:
                    stored.append((callers[index].user_id, key, outcome))
            idempotency.record_many(session, stored)
        answered = [reply for reply in replies if reply is not None]
        assert len(answered) == len(batch), "every submission is answered"
        return answered

    def _admit(self, session: Session, batch: Sequence[Submission],
               callers: Sequence[auth.Principal], now: datetime) -> list[Outcome]:
        """Admit the jobs; each gets 202 and its view, or its refusal as a problem."""
        outcomes: list[Outcome | None] = [None] * len(batch)
        named = _project_names(session, [callers[i].project_id for i, submission
                                         in enumerate(batch) if submission.project is not None])
        admitted: list[int] = []
        for index, (submission, caller) in enumerate(zip(batch, callers, strict=True)):
            if submission.project is not None and \
                    named.get(caller.project_id) != submission.project:
                outcomes[index] = idempotency.refusal(
                    NotFound(f"no project {submission.project!r}"))
            else:
                admitted.append(index)
        results = admission.admit(session, [
            admission.Submission(
                admission.Tenant(callers[i].org_id, callers[i].project_id, callers[i].user_id),
                batch[i].request,
                audit.Actor(f"user:{callers[i].user_id}", batch[i].request_id,
                            batch[i].idempotency_key))
            for i in admitted], self.platform.jobs, self._fleet_shapes(session), now)
        for index, result in zip(admitted, results, strict=True):
            if isinstance(result, DomainError) and result.status >= 500:
                raise result  # transient: nothing is stored, and a retry runs it again
            outcomes[index] = idempotency.refusal(result) if isinstance(result, DomainError) \
                else (202, job_view(result))
        return [outcome for outcome in outcomes if outcome is not None]

    def _fleet_shapes(self, session: Session) -> list[admission.Shape]:
        """The fleet's host shapes, read at most every few seconds."""
        if self._shapes is None or time.monotonic() - self._shapes[0] >= SHAPES_TTL_S:
            self._shapes = (time.monotonic(), admission.fleet_shapes(session))
        return self._shapes[1]


def _project_names(session: Session, project_ids: Sequence[str]) -> dict[str, str]:
    if not project_ids:
        return {}
    return {project_id: name for project_id, name in session.execute(
        select(Project.id, Project.name).where(among(session, Project.id, set(project_ids))))}
