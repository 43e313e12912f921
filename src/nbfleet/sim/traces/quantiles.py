"""Distributions given by a few published quantiles.

The paper reports percentiles, not parametric fits, so the generator samples from a
piecewise log-linear inverse CDF through them: between two knots ``(q0, x0)`` and
``(q1, x1)`` the value grows geometrically, ``x = x0 * (x1/x0) ** ((q-q0)/(q1-q0))``.
It hits every published quantile exactly, needs no numpy, and is monotone.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True, slots=True)
class QuantileDistribution:
    """Knots ``(q, x)`` with q rising from 0 to 1 and x positive and rising."""

    knots: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        qs = [q for q, _ in self.knots]
        xs = [x for _, x in self.knots]
        if len(self.knots) < 2 or qs[0] != 0.0 or qs[-1] != 1.0:
            raise ValueError("knots must start at q=0 and end at q=1")
        if any(b <= a for a, b in pairwise(qs)):
            raise ValueError("knot quantiles must strictly increase")
        if xs[0] <= 0 or any(b < a for a, b in pairwise(xs)):
            raise ValueError("knot values must be positive and non-decreasing")

    def quantile(self, q: float) -> float:
        """The inverse CDF at ``q`` in [0, 1]."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must lie in [0, 1], got {q}")
        qs = [k[0] for k in self.knots]
        i = min(max(bisect.bisect_right(qs, q) - 1, 0), len(qs) - 2)
        (q0, x0), (q1, x1) = self.knots[i], self.knots[i + 1]
        return x0 * math.pow(x1 / x0, (q - q0) / (q1 - q0))

    def sample(self, rng: random.Random) -> float:
        return self.quantile(rng.random())

    def mean(self) -> float:
        """Exact mean: each segment contributes ``(q1-q0) * (x1-x0) / ln(x1/x0)``."""
        total = 0.0
        for (q0, x0), (q1, x1) in pairwise(self.knots):
            width = q1 - q0
            total += width * x0 if x1 == x0 else width * (x1 - x0) / math.log(x1 / x0)
        return total


def empirical_quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated sample quantile (numpy's default method), for checks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
