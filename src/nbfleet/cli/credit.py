"""``nbfleet credit ...``: grants, balances, budgets, holds and the ledger check.

Amounts on the command line are credits (``10``, ``0.5``), converted exactly to the
integer micro-credits the API speaks; the tables show credits again.
"""

from __future__ import annotations

import os
import uuid
from decimal import Decimal, InvalidOperation
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nbfleet.cli.client import (
    JSON_ALWAYS_OPT,
    JSON_OPT,
    TOKEN_OPT,
    URL_OPT,
    Api,
    err,
    out,
    print_json,
    print_table,
    when,
)
from nbfleet.cli.home import home_dir, sqlite_url
from nbfleet.model.credits import MICRO

app = typer.Typer(help="Credits: grants, balances, the journal, budgets, holds, verify.",
                  no_args_is_help=True)
budget_app = typer.Typer(help="Spending limits per org, project or user (admin).",
                         no_args_is_help=True)
hold_app = typer.Typer(help="Holds, for operators and internal tools (admin token or the "
                            "cluster secret as --token).", no_args_is_help=True)
app.add_typer(budget_app, name="budget")
app.add_typer(hold_app, name="hold")

KEY_OPT = typer.Option(None, "--idempotency-key",
                       help="Idempotency-Key to send (default: a new uuid4); reuse it to retry")


def to_micro(text: str, what: str = "amount", zero_ok: bool = False) -> int:
    """Credits as typed (``10``, ``0.5``) to micro-credits, exactly, or exit 2."""
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite():
        err.print(f"[red]error:[/red] {what} {text!r} is not a number of credits")
        raise typer.Exit(2)
    micro = value * MICRO
    if micro != micro.to_integral_value():
        err.print(f"[red]error:[/red] {what} {text!r} has more than 6 decimals "
                  "(1 micro-credit is the smallest amount)")
        raise typer.Exit(2)
    if micro < 0 or (micro == 0 and not zero_ok):
        err.print(f"[red]error:[/red] {what} must be {'0 or more' if zero_ok else 'positive'}")
        raise typer.Exit(2)
    return int(micro)


def credits(micro: int | None) -> str:
    """Micro-credits shown as credits, without trailing zeros."""
    if micro is None:
        return "-"
    text = f"{Decimal(micro).scaleb(-6):,.6f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _key(key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": key or str(uuid.uuid4())}


def _drop_none(params: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in params.items() if value is not None}


@app.command("grant")
def grant(
    org: str = typer.Argument(..., help="Org name"),
    project: str | None = typer.Option(None, "--project",
                                       help="Project name (default: the org's shared wallet)"),
    amount: str = typer.Option(..., "--amount", help="Credits, e.g. 10 or 0.5 (6 decimals max)"),
    kind: str = typer.Option("grant", "--kind", help="purchase, grant or promo"),
    expires: str | None = typer.Option(None, "--expires",
                                       help="Expiry, RFC 3339 with a zone, e.g. 2027-01-01T00:00Z"),
    priority: int = typer.Option(0, "--priority", help="Lower numbers are spent first"),
    memo: str | None = typer.Option(None, "--memo", help="A note kept with the grant"),
    key: str | None = KEY_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Issue credits to an org's or a project's wallet (admin)."""
    body = {"org": org, "project": project, "kind": kind, "amount": to_micro(amount),
            "expires_at": expires, "priority": priority, "memo": memo}
    print_json(Api(url, token).json("POST", "/v1/credits/grants", json=body, headers=_key(key)))


@app.command("balance")
def balance(
    org: str | None = typer.Option(None, "--org", help="Org name (admins must give it)"),
    project: str | None = typer.Option(None, "--project", help="Project name"),
    scope: str | None = typer.Option(
        None, "--scope", help="project (your project's wallet) or org (the shared one)"),
    as_json: bool = JSON_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Show a wallet's balance in credits: promo against paid, and what expires next."""
    body = Api(url, token).json("GET", "/v1/credits/balance",
                                params=_drop_none({"org": org, "project": project, "scope": scope}))
    if as_json:
        print_json(body)
        return
    where = body["org"] + (f"/{body['project']}" if body.get("project") else " (org wallet)")
    table = Table(title=f"credits of {where}")
    for column in ("", "available", "held", "consumed", "expired", "granted"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row("total", *(credits(body[name]) for name in
                             ("available", "held", "consumed", "expired", "granted")))
    for label in ("paid", "promo"):
        table.add_row(label, credits(body[label]["available"]), credits(body[label]["held"]),
                      "", "", "")
    out.print(table)
    if body["upcoming_expirations"]:
        print_table(("grant", "kind", "credits", "expires at"),
                    [(item["grant_id"], item["kind"], credits(item["amount"]),
                      when(item["expires_at"])) for item in body["upcoming_expirations"]],
                    ids=("grant",), right=("credits",), title="next expirations")


@app.command("ledger")
def ledger(
    org: str | None = typer.Option(None, "--org"),
    project: str | None = typer.Option(None, "--project"),
    scope: str | None = typer.Option(None, "--scope", help="project or org"),
    after: int | None = typer.Option(None, "--after", help="Cursor: the previous page's next"),
    limit: int = typer.Option(100, "--limit", min=1, max=500),
    as_json: bool = JSON_ALWAYS_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Print a wallet's journal entries (JSON, oldest first, one page)."""
    params = _drop_none({"org": org, "project": project, "scope": scope, "after": after,
                         "limit": limit})
    print_json(Api(url, token).json("GET", "/v1/credits/ledger", params=params))


@app.command("audit")
def audit(
    org: str | None = typer.Option(None, "--org"),
    project: str | None = typer.Option(None, "--project"),
    since: str | None = typer.Option(None, "--since", help="RFC 3339 with a zone"),
    until: str | None = typer.Option(None, "--until", help="RFC 3339 with a zone"),
    after: int | None = typer.Option(None, "--after", help="Cursor: the previous page's next"),
    limit: int = typer.Option(100, "--limit", min=1, max=500),
    as_json: bool = JSON_ALWAYS_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Print credit decisions: who, which request and key, before and after (JSON)."""
    params = _drop_none({"org": org, "project": project, "since": since, "until": until,
                         "after": after, "limit": limit})
    print_json(Api(url, token).json("GET", "/v1/credits/audit", params=params))


@budget_app.command("set")
def budget_set(
    org: str = typer.Argument(..., help="Org name"),
    project: str | None = typer.Option(None, "--project", help="Limit this project"),
    user: str | None = typer.Option(None, "--user", help="Limit this user of the org"),
    period: str = typer.Option("month", "--period", help="day or month"),
    limit: str = typer.Option(..., "--limit", help="Credits per period"),
    enforcement: str = typer.Option("hard", "--enforcement",
                                    help="hard (refuse), soft (alert) or cap (stop new work)"),
    key: str | None = KEY_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Create a budget for an org, or one of its projects or users."""
    body = {"org": org, "project": project, "user": user, "period": period,
            "limit": to_micro(limit, "limit", zero_ok=True), "enforcement": enforcement}
    print_json(Api(url, token).json("POST", "/v1/credits/budgets", json=body, headers=_key(key)))


@budget_app.command("list")
def budget_list(
    org: str | None = typer.Option(None, "--org", help="Admins: only this org's"),
    as_json: bool = JSON_ALWAYS_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """List budgets (an admin's: all or one org's; a user's: those that apply to them)."""
    print_json(Api(url, token).json("GET", "/v1/credits/budgets",
                                    params=_drop_none({"org": org})))


@budget_app.command("update")
def budget_update(
    budget_id: str,
    limit: str = typer.Option(..., "--limit", help="New limit in credits per period"),
    key: str | None = KEY_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Change a budget's limit."""
    print_json(Api(url, token).json("PATCH", f"/v1/credits/budgets/{budget_id}",
                                    json={"limit": to_micro(limit, "limit", zero_ok=True)},
                                    headers=_key(key)))


@budget_app.command("delete")
def budget_delete(budget_id: str, key: str | None = KEY_OPT, url: str | None = URL_OPT,
                  token: str | None = TOKEN_OPT) -> None:
    """Remove a budget."""
    print_json(Api(url, token).json("DELETE", f"/v1/credits/budgets/{budget_id}",
                                    headers=_key(key)))


@hold_app.command("get")
def hold_get(hold_id: str, as_json: bool = JSON_ALWAYS_OPT, url: str | None = URL_OPT,
             token: str | None = TOKEN_OPT) -> None:
    """Show a hold."""
    print_json(Api(url, token).json("GET", f"/v1/credits/holds/{hold_id}"))


@hold_app.command("reserve")
def hold_reserve(
    work_id: str = typer.Option(..., "--work-id", help="The job or kernel it pays for"),
    org_id: str = typer.Option(..., "--org-id"),
    project_id: str = typer.Option(..., "--project-id"),
    user_id: str | None = typer.Option(None, "--user-id"),
    gpu_type: str = typer.Option(..., "--gpu-type"),
    rate: str = typer.Option(..., "--rate", help="Credits per GPU-hour"),
    amount: str = typer.Option(..., "--amount", help="Credits to hold"),
    lease_s: int = typer.Option(300, "--lease", min=1, help="Seconds without a report before "
                                                            "the reaper releases it"),
    key: str | None = KEY_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Reserve credits for a piece of work (one hold per work id)."""
    body = {"work_id": work_id, "org_id": org_id, "project_id": project_id, "user_id": user_id,
            "gpu_type": gpu_type, "rate_per_gpu_hour": to_micro(rate, "rate", zero_ok=True),
            "amount": to_micro(amount), "lease_s": lease_s}
    print_json(Api(url, token).json("POST", "/v1/credits/holds", json=body, headers=_key(key)))


@hold_app.command("usage")
def hold_usage(
    hold_id: str,
    seq: int = typer.Option(..., "--seq", min=1, help="Report sequence number"),
    gpu_ms: int = typer.Option(..., "--gpu-ms", min=0, help="Cumulative GPU-milliseconds"),
    key: str | None = KEY_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Report a hold's cumulative usage."""
    print_json(Api(url, token).json("POST", f"/v1/credits/holds/{hold_id}/usage",
                                    json={"seq": seq, "gpu_ms": gpu_ms}, headers=_key(key)))


@hold_app.command("settle")
def hold_settle(
    hold_id: str,
    reason: str = typer.Option("finished", "--reason",
                               help="finished, preempted, failed or cancelled"),
    final_seq: int | None = typer.Option(None, "--final-seq", min=1),
    final_gpu_ms: int | None = typer.Option(None, "--final-gpu-ms", min=0),
    key: str | None = KEY_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Release what a hold still holds (after a final usage report, if given)."""
    body: dict[str, Any] = {"reason": reason}
    if (final_seq is None) != (final_gpu_ms is None):
        err.print("[red]error:[/red] --final-seq and --final-gpu-ms go together")
        raise typer.Exit(2)
    if final_seq is not None:
        body["final"] = {"seq": final_seq, "gpu_ms": final_gpu_ms}
    print_json(Api(url, token).json("POST", f"/v1/credits/holds/{hold_id}/settle", json=body,
                                    headers=_key(key)))


@app.command("verify")
def verify(
    db: str | None = typer.Option(None, "--db", help="SQLAlchemy URL [default: $NBFLEET_DB, "
                                                     "else the SQLite DB of the home dir]"),
    home: str | None = typer.Option(None, "--home", envvar="NBFLEET_HOME",
                                    help="State directory [default: ./.nbfleet]"),
    as_json: bool = JSON_OPT,
) -> None:
    """Recompute every wallet from the journal; exit 1 if anything disagrees."""
    from nbfleet.db.engine import Database
    from nbfleet.ledger.verify import verify_db

    url = db or os.environ.get("NBFLEET_DB")
    if url is None:
        state = home_dir(home)
        if not (state / "nbfleet.db").exists():
            err.print(f"[red]error:[/red] no database at {state / 'nbfleet.db'}; pass --db")
            raise typer.Exit(2)
        url = sqlite_url(state)
    database = Database(url)
    try:
        report = verify_db(database)
    finally:
        database.dispose()
    if as_json:
        print_json(report.as_json())
    else:
        amounts = ("granted", "available", "held", "consumed", "expired")
        print_table(("wallet", *amounts),
                    [(owner, *(credits(totals[name]) for name in amounts))
                     for owner, totals in sorted(report.totals.items())],
                    ids=("wallet",), right=amounts,
                    title=f"{report.wallets} wallets, {report.buckets} grants, "
                          f"{report.holds} holds, {report.entries} journal entries")
        for mismatch in report.mismatches:
            err.print(f"[red]mismatch:[/red] {escape(mismatch)}")
        if report.ok:
            out.print("[green]ok[/green]: the balances match the journal")
    if not report.ok:
        raise typer.Exit(1)
