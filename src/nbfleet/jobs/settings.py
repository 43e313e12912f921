"""The knobs of the job system, in one value the control plane builds from its config."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbfleet.model.jobs import RetryRules
from nbfleet.model.pricing import PriceTable, parse_prices

DEFAULT_TIERS = {"free": 0, "paid": 10}


@dataclass(frozen=True)
class JobSettings:
    tiers: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    prices: PriceTable = field(default_factory=lambda: parse_prices("default=1"))
    retry: RetryRules = field(default_factory=RetryRules)
    #: An attempt silent for this long is lost (its host died or was cut off).
    heartbeat_timeout_s: float = 15.0
    #: How long results are kept, and how long a signed result URL is valid.
    result_retention_s: float = 7 * 86400.0
    result_url_ttl_s: float = 3600.0
    #: SIGTERM to SIGKILL, for timeouts, cancels and preemptions.
    kill_grace_s: float = 10.0
    #: Fair share: the half-life of remembered usage.
    usage_half_life_s: float = 3600.0
    #: Limits a request must stay within.
    max_gpus: int = 16
    max_timeout_s: int = 7 * 86400
    default_memory_mb: int = 16384
