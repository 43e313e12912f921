"""Credits in the browser: a wallet's balance, its journal (keyset pages, newest
first) and the budgets that apply, through the credits API's own functions.

Users see their project's wallet (or, ``?scope=org``, their org's shared one); an
admin names any org and project. Naming another tenant's answers 404.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from sqlalchemy import select

from nbfleet.control.dashboard.pages import PAGE_SIZE, PageRoute, render, viewer
from nbfleet.control.deps import platform_of
from nbfleet.control.routers.budgets import _applies_to
from nbfleet.control.routers.credits import wallet_owner
from nbfleet.db.credit_tables import Budget, LedgerEntry
from nbfleet.ledger import budgets, grants, wallets
from nbfleet.web.render import iso

router = APIRouter(route_class=PageRoute)



@router.get("/ui/credits")
def credits_page(request: Request, org: str | None = Query(None, max_length=100),
                 project: str | None = Query(None, max_length=100),
                 scope: Literal["project", "org"] | None = None,
                 before: int | None = Query(None, ge=1)) -> Response:
    me = viewer(request)
    principal = me.principal
    db = platform_of(request).db
    wanted = {"org": org, "project": project, "scope": scope}
    query = urlencode({k: v for k, v in wanted.items() if v})
    context: dict[str, Any] = {"org": org or "", "project": project or "", "scope": scope,
                               "page_base": "/ui/credits" + (f"?{query}" if query else "")}
    if principal.is_admin and not org:
        return render(request, me, "credits.html", title="Credits", section="credits",
                      balance=None, entries=[], next_before=None, budgets=[], **context)
    with db.transaction() as session:  # expire first: expired credits never show available
        owner = wallet_owner(session, principal, org, project, scope)
        now = db.now(session)
        wallet = wallets.find(session, owner)
        entries: list[LedgerEntry] = []
        if wallet is not None:
            grants.expire_due(session, now, wallet_ids=[wallet.id])
            journal = (select(LedgerEntry).where(LedgerEntry.wallet_id == wallet.id)
                     .order_by(LedgerEntry.id.desc()).limit(PAGE_SIZE + 1))
            if before is not None:
                journal = journal.where(LedgerEntry.id < before)
            entries = list(session.execute(journal).scalars())
        balance = grants.balance(session, owner, now)
        rules = select(Budget).order_by(Budget.id)
        rules = (rules.where(_applies_to(principal)) if not principal.is_admin
                 else rules.where(Budget.org_id == owner.org_id))
        budget_rows = [budgets.view(session, budget, now)
                       for budget in session.execute(rules.limit(200)).scalars()]
    more = len(entries) > PAGE_SIZE
    entries = entries[:PAGE_SIZE]
    return render(request, me, "credits.html", title="Credits", section="credits",
                  balance=balance, budgets=budget_rows, paged=before is not None,
                  entries=[{"id": e.id, "kind": e.kind, "account": e.account,
                            "amount": e.amount, "bucket_id": e.bucket_id,
                            "hold_id": e.hold_id, "at": iso(e.created_at)} for e in entries],
                  next_before=entries[-1].id if more else None, **context)
