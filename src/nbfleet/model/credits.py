"""Credit arithmetic: spend order, metered cost, budget periods and budget verdicts.

Pure: amounts are integer micro-credits, times are passed in. The ledger in
``nbfleet.ledger`` applies these rules inside DB transactions; the reference model
in the ledger's property test applies the very same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

#: One credit is a million micro-credits; every stored amount is an integer of these.
MICRO = 1_000_000
#: Usage counters are GPU-milliseconds; prices are per GPU-hour.
MS_PER_HOUR = 3_600_000
#: The largest amount the ledger accepts in one call (a trillion credits).
MAX_AMOUNT = 10**18


class GrantKind(StrEnum):
    PURCHASE = "purchase"
    GRANT = "grant"
    PROMO = "promo"


#: The expiry slot of a never-expiring bucket: the same for all of them, so the kind
#: and then the age decide between them (the ``never`` flag already sorts them last).
_NEVER = datetime.max.replace(tzinfo=UTC)

#: "promo before paid": promotional credits go first, purchased credits last.
_KIND_RANK = {GrantKind.PROMO: 0, GrantKind.GRANT: 1, GrantKind.PURCHASE: 2}


@dataclass(frozen=True, slots=True)
class BucketKey:
    """What the spend order looks at in a bucket (a grant's remainder)."""

    id: str
    priority: int
    expires_at: datetime | None
    kind: GrantKind
    created_at: datetime


def spend_order_key(bucket: BucketKey) -> tuple[int, int, datetime, int, datetime, str]:
    """Lower priority numbers first, then earliest expiry (never-expiring last),
    then promo before grant before purchase, then the oldest; the id breaks ties."""
    never = bucket.expires_at is None
    expiry = _NEVER if bucket.expires_at is None else bucket.expires_at
    return (bucket.priority, int(never), expiry, _KIND_RANK[bucket.kind], bucket.created_at,
            bucket.id)


def is_expired(expires_at: datetime | None, now: datetime) -> bool:
    return expires_at is not None and expires_at <= now


def draw(available: list[tuple[str, int]], amount: int) -> list[tuple[str, int]]:
    """Take ``amount`` from buckets already in spend order: [(bucket, taken), ...].

    Takes what there is when the buckets hold less; the caller decides whether a
    short draw is a refusal (reserve) or an exhausted hold (usage).
    """
    taken: list[tuple[str, int]] = []
    left = amount
    for bucket_id, have in available:
        if left <= 0:
            break
        part = min(have, left)
        if part > 0:
            taken.append((bucket_id, part))
            left -= part
    return taken


def usage_cost(gpu_ms: int, rate_per_gpu_hour: int) -> int:
    """Micro-credits owed for a cumulative GPU-millisecond counter, rounded up, so a
    sliver of usage is never free and a cumulative recount never charges twice."""
    return -(-gpu_ms * rate_per_gpu_hour // MS_PER_HOUR)


class Period(StrEnum):
    DAY = "day"
    MONTH = "month"


def period_key(period: Period, now: datetime) -> str:
    """The UTC calendar period ``now`` falls in, e.g. ``day:2026-11-23``."""
    if period is Period.DAY:
        return f"day:{now:%Y-%m-%d}"
    return f"month:{now:%Y-%m}"


class Level(StrEnum):
    ORG = "org"
    PROJECT = "project"
    USER = "user"


class Enforcement(StrEnum):
    #: Refuse a hold that would take spent + held past the limit.
    HARD = "hard"
    #: Admit, and emit one alert event per period once the limit is passed.
    SOFT = "soft"
    #: A real-time spend cap: refuse new holds once spent + held has reached the
    #: limit. The last admitted hold may cross it, because a job's true cost is
    #: known only when it ends.
    CAP = "cap"


@dataclass(frozen=True, slots=True)
class BudgetRule:
    id: str
    level: Level
    period: Period
    limit: int
    enforcement: Enforcement


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of checking one budget against a requested increase."""

    rule: BudgetRule
    committed_before: int
    refused: bool
    alert: bool

    @property
    def reason(self) -> str:
        rule = self.rule
        after = self.committed_before
        if rule.enforcement is Enforcement.CAP:
            return (f"{rule.level} spend cap reached: {after} of {rule.limit} micro-credits "
                    f"spent or held this {rule.period}")
        return (f"{rule.level} {rule.period} budget of {rule.limit} micro-credits would be "
                f"exceeded: {after} already spent or held")


def judge(rule: BudgetRule, committed_before: int, amount: int) -> Verdict:
    """Check a budget whose period has ``committed_before`` spent or held already."""
    after = committed_before + amount
    if rule.enforcement is Enforcement.HARD:
        return Verdict(rule, committed_before, after > rule.limit, False)
    if rule.enforcement is Enforcement.CAP:
        return Verdict(rule, committed_before, committed_before >= rule.limit, False)
    return Verdict(rule, committed_before, False, after > rule.limit >= committed_before)
