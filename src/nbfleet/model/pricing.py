"""GPU prices per type, and what a job must hold before it may queue.

A job may accept several GPU types, and which one it gets is decided at start. The
admission hold is therefore priced at the dearest acceptable type, so it covers
any placement; at start the hold is repriced to the type actually bound, and the
difference comes back when the hold settles.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from nbfleet.model.credits import MICRO, usage_cost
from nbfleet.model.errors import InvalidInput

DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Micro-credits per GPU-hour by GPU type; ``default`` prices any other type."""

    rates: Mapping[str, int]

    def __post_init__(self) -> None:
        if DEFAULT not in self.rates:
            raise InvalidInput("a price table needs a 'default' rate")
        if any(rate < 0 for rate in self.rates.values()):
            raise InvalidInput("prices must not be negative")

    def rate(self, gpu_type: str) -> int:
        return self.rates.get(gpu_type, self.rates[DEFAULT])

    def dearest(self, gpu_types: Iterable[str], known_types: Iterable[str]) -> tuple[str, int]:
        """The dearest type (and its rate) among those a job accepts.

        A job that accepts any type (``gpu_types`` empty) may land on any type the
        fleet has (``known_types``) or, failing those, the default.
        """
        candidates = list(gpu_types) or list(known_types) or [DEFAULT]
        best = max(candidates, key=lambda t: (self.rate(t), t))
        return best, self.rate(best)


def parse_prices(spec: str) -> PriceTable:
    """``"default=1,A100-80GB=2.5,H100-80GB=4"``: credits per GPU-hour."""
    rates: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, raw = part.partition("=")
        if not sep or not name.strip():
            raise InvalidInput(f"invalid price {part!r}: expected TYPE=CREDITS, e.g. H100-80GB=4")
        try:
            credits = Decimal(raw.strip())
        except InvalidOperation as exc:
            raise InvalidInput(f"invalid price {part!r}: not a number") from exc
        if not credits.is_finite() or credits < 0:
            raise InvalidInput(f"invalid price {part!r}: must be 0 or more")
        rates[name.strip()] = int(credits * MICRO)
    rates.setdefault(DEFAULT, MICRO)
    return PriceTable(rates)


def hold_amount(timeout_s: int, gpus: int, rate_per_gpu_hour: int) -> int:
    """Micro-credits that cover ``gpus`` GPUs for ``timeout_s`` at the rate (at least 1,
    since a hold of nothing would be no hold)."""
    return max(1, usage_cost(timeout_s * 1000 * gpus, rate_per_gpu_hour))
