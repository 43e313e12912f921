"""The credit ledger on the metadata DB: grants, holds, metering, budgets, audit.

Functions here take an open session and the DB clock's ``now`` and never commit:
the caller's transaction is the unit of work, so admission can reserve credit and
enqueue the work in one transaction. ``ledger.service`` opens the transactions for
callers that have none (the API, the reaper, the benchmark). ``docs/ledger.md``
explains the schema, the spend order and the locking.
"""
