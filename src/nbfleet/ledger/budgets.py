"""Hierarchical budgets (org, project, user) and the spend counters they read.

A counter holds spent plus held for one scope and one calendar period. A hold adds
its amount when it is admitted (and when it is extended) to the counters of its
admission's day and month, and takes back what it releases. Captures move credits
from held to consumed and leave the counters alone, so the metering path never
touches them, and a budget check is one indexed read per level.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, text, update
from sqlalchemy.orm import Session

from nbfleet.db.bulk import run_arrays, unnest
from nbfleet.db.credit_tables import Budget, SpendCounter
from nbfleet.db.ids import new_id
from nbfleet.db.queries import among
from nbfleet.db.tables import Org, Project, User
from nbfleet.ledger import audit
from nbfleet.model.credits import (
    MAX_AMOUNT,
    BudgetRule,
    Enforcement,
    Level,
    Period,
    Verdict,
    judge,
    period_key,
)
from nbfleet.model.errors import Conflict, InvalidInput, NotFound, PaymentRequired
from nbfleet.web.metrics import CREDIT_BUDGET_ALERTS
from nbfleet.web.render import iso


@dataclass(frozen=True, slots=True)
class Scopes:
    """The three levels a piece of work is accounted to."""

    org_id: str
    project_id: str
    user_id: str | None

    def keys(self) -> dict[Level, str]:
        keys = {Level.ORG: f"org:{self.org_id}", Level.PROJECT: f"project:{self.project_id}"}
        if self.user_id:
            keys[Level.USER] = f"user:{self.user_id}"
        return keys


def _counter_keys(scopes: Scopes, periods: tuple[str, str]) -> list[tuple[str, str]]:
    """The (scope, period) counters a hold counts against, in key order (the lock order)."""
    return sorted({(key, period) for key in scopes.keys().values() for period in periods})


def _add_to_counters(session: Session, amounts: Mapping[tuple[str, str], int]
                     ) -> dict[tuple[str, str], int]:
    """Add to the counters (creating missing ones) in key order, the lock order, in
    one upsert; return their new values."""
    keys = sorted(amounts)
    if not keys:
        return {}
    rows = [{"scope": scope, "period": period, "amount": amounts[scope, period]}
            for scope, period in keys]
    upsert = ("INSERT INTO credit_spend (scope, period, amount) {values} ON CONFLICT "
              "(scope, period) DO UPDATE SET amount = credit_spend.amount + excluded.amount "
              "RETURNING scope, period, amount")
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        source, arrays = unnest(connection, SpendCounter.__table__,  # type: ignore[arg-type]
                                rows)
        result = run_arrays(connection, upsert.format(
            values=f"SELECT scope, period, amount FROM {source}"), arrays)
    else:
        values = "VALUES " + ", ".join(f"(:s{i}, :p{i}, :a{i})" for i in range(len(keys)))
        params = {f"{letter}{i}": row[column] for i, row in enumerate(rows)
                  for letter, column in (("s", "scope"), ("p", "period"), ("a", "amount"))}
        result = [tuple(row) for row in connection.execute(
            text(upsert.format(values=values)), params)]
    return {(scope, period): value for scope, period, value in result}


@dataclass(frozen=True, slots=True)
class Charge:
    """An amount a hold commits against its levels' budgets."""

    scopes: Scopes
    periods: tuple[str, str]
    amount: int
    actor: audit.Actor
    subject_id: str


def commit(session: Session, scopes: Scopes, periods: tuple[str, str], amount: int,
           actor: audit.Actor, now: datetime, subject_id: str) -> None:
    """Count ``amount`` against every level's budgets, or refuse it with the reason
    (``PaymentRequired``; nothing is counted then)."""
    charge = Charge(scopes, periods, amount, actor, subject_id)
    book = BudgetBook.open(session, [charge])
    refusal = book.charge(charge)
    book.close(session, now)
    if refusal is not None:
        raise refusal


class BudgetBook:
    """The budgets and spend counters of a batch of charges, judged one by one.

    ``open`` reads the budgets of every scope involved and, if there are any,
    locks (upserts) the counters in key order, the lock order. ``charge`` judges
    one charge against what the counters hold plus the charges accepted before it,
    in memory; ``close`` adds the accepted sums in one upsert and records alerts.
    With no budget on any scope, nothing is locked or read before ``close``.
    """

    def __init__(self, rules: dict[str, list[BudgetRule]],
                 current: dict[tuple[str, str], int]) -> None:
        self._rules = dict(rules)
        self._current = current
        self._added: dict[tuple[str, str], int] = defaultdict(int)
        self._alerts: list[tuple[audit.Actor, audit.AuditRow]] = []

    @classmethod
    def open(cls, session: Session, charges: Sequence[Charge]) -> BudgetBook:
        scopes = sorted({key for charge in charges for key in charge.scopes.keys().values()})
        rules: dict[str, list[BudgetRule]] = defaultdict(list)
        query = select(Budget).where(among(session, Budget.scope, scopes))
        for budget in session.execute(query).scalars():
            rules[budget.scope].append(rule_of(budget))
        current: dict[tuple[str, str], int] = {}
        if rules:
            current = _add_to_counters(session, dict.fromkeys(
                {key for charge in charges
                 for key in _counter_keys(charge.scopes, charge.periods)}, 0))
        return cls(rules, current)

    def charge(self, charge: Charge) -> PaymentRequired | None:
        """Count ``charge``, or return why a budget refuses it (then it counts nothing)."""
        verdicts = [judge(rule, self._current[scope, _period_of(rule, charge.periods)],
                          charge.amount)
                    for scope in charge.scopes.keys().values()
                    for rule in self._rules.get(scope, ())]
        refusal = _refusal([verdict for verdict in verdicts if verdict.refused])
        if refusal is not None:
            return refusal
        for key in _counter_keys(charge.scopes, charge.periods):
            if self._rules:
                self._current[key] += charge.amount
            self._added[key] += charge.amount
        for verdict in verdicts:
            if verdict.alert:
                CREDIT_BUDGET_ALERTS.labels(str(verdict.rule.level)).inc()
                self._alerts.append((charge.actor, _alert_row(charge, verdict)))
        return None

    def close(self, session: Session, now: datetime) -> None:
        _add_to_counters(session, {key: amount for key, amount in self._added.items()
                                   if amount})
        audit.record_each(session, now, self._alerts)


def _period_of(rule: BudgetRule, periods: tuple[str, str]) -> str:
    return periods[0] if rule.period is Period.DAY else periods[1]


def _refusal(refused: list[Verdict]) -> PaymentRequired | None:
    """The refusal of the widest level among those that refuse."""
    if not refused:
        return None
    first = min(refused, key=lambda v: list(Level).index(v.rule.level))
    return PaymentRequired(
        first.reason, reason=("spend_cap_reached" if first.rule.enforcement == Enforcement.CAP
                              else "budget_exceeded"),
        budget_id=first.rule.id, level=str(first.rule.level), limit=first.rule.limit,
        committed=first.committed_before)


def _alert_row(charge: Charge, verdict: Verdict) -> audit.AuditRow:
    return audit.AuditRow(
        "budget_alert", verdict.rule.id, charge.scopes.org_id, charge.scopes.project_id, None,
        {"committed": verdict.committed_before},
        {"committed": verdict.committed_before + charge.amount, "limit": verdict.rule.limit,
         "level": str(verdict.rule.level), "period": str(verdict.rule.period),
         "work": charge.subject_id})


_GIVE_BACK = (
    update(SpendCounter)
    .where(SpendCounter.scope == bindparam("k_scope"), SpendCounter.period == bindparam("k_period"))
    .values(amount=SpendCounter.amount - bindparam("k_amount"))
)


def uncommit(session: Session, scopes: Scopes, periods: tuple[str, str], amount: int) -> None:
    """Take back credits a hold released (in key order, like ``commit``)."""
    if amount <= 0:
        return
    rows = _counter_keys(scopes, periods)
    session.connection().execute(_GIVE_BACK, [
        {"k_scope": key, "k_period": period, "k_amount": amount} for key, period in rows])


def periods_at(now: datetime) -> tuple[str, str]:
    return period_key(Period.DAY, now), period_key(Period.MONTH, now)


def rule_of(budget: Budget) -> BudgetRule:
    return BudgetRule(budget.id, Level(budget.level), Period(budget.period), budget.limit,
                      Enforcement(budget.enforcement))


def committed(session: Session, scope: str, period: str) -> int:
    value = session.execute(select(SpendCounter.amount).where(
        SpendCounter.scope == scope, SpendCounter.period == period)).scalar_one_or_none()
    return int(value or 0)


def view(session: Session, budget: Budget, now: datetime) -> dict[str, Any]:
    period = period_key(Period(budget.period), now)
    return {
        "id": budget.id, "level": budget.level, "org_id": budget.org_id,
        "project_id": budget.project_id, "user_id": budget.user_id,
        "period": budget.period, "limit": budget.limit, "enforcement": budget.enforcement,
        "current_period": period, "committed": committed(session, budget.scope, period),
        "created_at": iso(budget.created_at), "updated_at": iso(budget.updated_at),
    }


@dataclass(frozen=True, slots=True)
class BudgetTarget:
    """Which org, project or user a budget limits (resolved to ids)."""

    level: Level
    org_id: str
    project_id: str | None
    user_id: str | None

    @property
    def scope(self) -> str:
        ident = {Level.ORG: self.org_id, Level.PROJECT: self.project_id,
                 Level.USER: self.user_id}[self.level]
        return f"{self.level}:{ident}"


def target_by_names(session: Session, org: str, project: str | None,
                    user: str | None) -> BudgetTarget:
    """Resolve names; the most specific one given sets the level."""
    org_row = session.execute(select(Org).where(Org.name == org)).scalar_one_or_none()
    if org_row is None:
        raise NotFound(f"org {org!r} not found")
    if user is not None:
        user_row = session.execute(select(User).where(
            User.org_id == org_row.id, User.name == user)).scalar_one_or_none()
        if user_row is None:
            raise NotFound(f"user {org}/{user} not found")
        return BudgetTarget(Level.USER, org_row.id, user_row.project_id, user_row.id)
    if project is not None:
        project_row = session.execute(select(Project).where(
            Project.org_id == org_row.id, Project.name == project)).scalar_one_or_none()
        if project_row is None:
            raise NotFound(f"project {org}/{project} not found")
        return BudgetTarget(Level.PROJECT, org_row.id, project_row.id, None)
    return BudgetTarget(Level.ORG, org_row.id, None, None)


def _check_limit(limit: int) -> None:
    if not 0 <= limit <= MAX_AMOUNT:
        raise InvalidInput(f"limit must be between 0 and {MAX_AMOUNT} micro-credits",
                           field="limit")


def create(session: Session, target: BudgetTarget, period: Period, limit: int,
           enforcement: Enforcement, actor: audit.Actor, now: datetime) -> Budget:
    _check_limit(limit)
    exists = session.execute(select(Budget.id).where(
        Budget.scope == target.scope, Budget.period == str(period),
        Budget.enforcement == str(enforcement))).scalar_one_or_none()
    if exists:
        raise Conflict(f"a {enforcement} {period} budget already exists for this {target.level}",
                       budget_id=exists)
    budget = Budget(id=new_id("bud"), org_id=target.org_id, project_id=target.project_id,
                    user_id=target.user_id, level=str(target.level), scope=target.scope,
                    period=str(period), limit=limit, enforcement=str(enforcement),
                    created_at=now, updated_at=now)
    session.add(budget)
    session.flush()
    audit.record(session, actor, now, [audit.AuditRow(
        "budget_create", budget.id, budget.org_id, budget.project_id, None, None,
        _plain(budget))])
    return budget


def update_limit(session: Session, budget: Budget, limit: int, actor: audit.Actor,
                 now: datetime) -> Budget:
    _check_limit(limit)
    before = _plain(budget)
    budget.limit = limit
    budget.updated_at = now
    audit.record(session, actor, now, [audit.AuditRow(
        "budget_update", budget.id, budget.org_id, budget.project_id, None, before,
        _plain(budget))])
    return budget


def delete(session: Session, budget: Budget, actor: audit.Actor, now: datetime) -> None:
    audit.record(session, actor, now, [audit.AuditRow(
        "budget_delete", budget.id, budget.org_id, budget.project_id, None, _plain(budget),
        None)])
    session.delete(budget)


def _plain(budget: Budget) -> dict[str, Any]:
    return {"level": budget.level, "scope": budget.scope, "period": budget.period,
            "limit": budget.limit, "enforcement": budget.enforcement}
