"""GPU jobs on the metadata DB: admission, the queue, attempts, rollout, results.

Like ``ledger``, functions here take an open session and the DB clock's ``now``
and never commit, so admission reserves credit and enqueues in one transaction.
The loops that drive them (dispatch, lost-worker detection, retention) live in
``control``; the rules they apply are pure, in ``model.jobs`` and ``policy``.
``docs/jobs.md`` describes the lifecycle.

Lock order, shared with the ledger so the two never deadlock: job rows by id,
then attempt rows, then holds, buckets and spend counters (``ledger.holds``),
then binary versions, then tenant usage rows by id.
"""
