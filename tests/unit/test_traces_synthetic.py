"""The synthetic SenseiTrace generator against the paper's published statistics."""

from __future__ import annotations

import random
import statistics
from functools import cache

import pytest

from nbfleet.sim.traces import Trace, TraceError, sensei
from nbfleet.sim.traces.quantiles import QuantileDistribution, empirical_quantile
from nbfleet.sim.traces.synthetic import TASK_DURATION_S, THINK_TIME_S

HOURS = 17.5
TOLERANCE = 0.15

# Paper, section 2.3: task duration percentiles (minutes) and within-session IATs (s).
DURATION_MIN = {0.50: 2.0, 0.75: 5.0, 0.90: 17.0, 0.95: 36.0, 0.99: 182.0}
IAT_S = {0.50: 300.0, 0.75: 480.0}


@cache
def big_trace() -> Trace:
    """~45,000 tasks: enough that the p99 estimate sits well inside the tolerance."""
    return sensei(HOURS, seed=2024, sessions_per_hour=600)


@pytest.mark.parametrize(("q", "minutes"), sorted(DURATION_MIN.items()))
def test_task_duration_quantiles_match_the_paper(q: float, minutes: float) -> None:
    durations = [t.duration_s for s in big_trace().sessions for t in s.tasks]
    assert len(durations) > 30_000
    assert empirical_quantile(durations, q) == pytest.approx(minutes * 60, rel=TOLERANCE)


def test_iat_quantiles_and_minimum_match_the_paper() -> None:
    gaps = [g for s in big_trace().sessions for g in s.think_times()]
    assert len(gaps) > 20_000
    for q, seconds in IAT_S.items():
        assert empirical_quantile(gaps, q) == pytest.approx(seconds, rel=TOLERANCE)
    assert min(gaps) >= 240.0


def test_tasks_in_a_session_never_overlap() -> None:
    for session in big_trace().sessions[:2000]:
        assert all(gap >= 240.0 for gap in session.think_times())


def test_busy_share_distribution_matches_figure_2c() -> None:
    shares = [s.busy_share for s in big_trace().sessions]
    at_most_5 = sum(x <= 0.05 for x in shares) / len(shares)
    at_most_31 = sum(x <= 0.3113 for x in shares) / len(shares)
    assert at_most_5 == pytest.approx(0.75, abs=0.07)
    assert at_most_31 == pytest.approx(0.90, abs=0.05)


def test_default_rate_reaches_figure_7_active_sessions() -> None:
    horizon = HOURS * 3600
    alive = []
    for seed in range(10):
        trace = sensei(HOURS, seed)
        alive.append(sum(1 for s in trace.sessions if s.end_s >= horizon))
        assert all(t.submit_s < horizon for s in trace.sessions for t in s.tasks)
        assert all(s.gpus in (1, 2, 4, 8) for s in trace.sessions)
    # paper: 87 active sessions at the end of the 17.5-hour excerpt
    assert 78 <= statistics.mean(alive) <= 96


def test_active_at_end_and_rate_options() -> None:
    slow = sensei(10.0, seed=3, sessions_per_hour=2.0)
    fast = sensei(10.0, seed=3, active_at_end=200)
    assert len(slow.sessions) < 40 < len(fast.sessions)
    with pytest.raises(TraceError, match="not both"):
        sensei(1.0, seed=0, sessions_per_hour=1.0, active_at_end=5)
    with pytest.raises(TraceError, match="hours must be positive"):
        sensei(0.0, seed=0)


def test_same_seed_same_trace() -> None:
    assert sensei(6.0, seed=42) == sensei(6.0, seed=42)
    assert sensei(6.0, seed=42).sessions != sensei(6.0, seed=43).sessions


def test_quantile_distribution_hits_its_knots_and_mean() -> None:
    for dist in (TASK_DURATION_S, THINK_TIME_S):
        for q, x in dist.knots:
            assert dist.quantile(q) == pytest.approx(x)
        rng = random.Random(1)
        sample = [dist.sample(rng) for _ in range(20_000)]
        assert statistics.fmean(sample) == pytest.approx(dist.mean(), rel=0.05)
    with pytest.raises(ValueError, match="start at q=0"):
        QuantileDistribution(((0.1, 1.0), (1.0, 2.0)))
