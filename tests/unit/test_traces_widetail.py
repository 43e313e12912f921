"""The wide, heavy-tailed month (``synthetic:widetail``) against the production
month issue 28 quotes: 30,909 tasks; 1/4/8 GPUs at 49/20/31 %; duration p50 5 min,
p99 17 h; think time p50 3 min, p90 35 min, 7.8 % of gaps over 1 h; a physical
lower bound of 155,502 GPU-h."""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest

from nbfleet.sim.traces import Trace, TraceError
from nbfleet.sim.traces.quantiles import empirical_quantile
from nbfleet.sim.traces.source import load_trace
from nbfleet.sim.traces.widetail import widetail

TOLERANCE = 0.15


@cache
def month() -> Trace:
    return widetail()


def test_a_month_holds_about_as_many_tasks_and_gpu_hours_as_the_measured_one() -> None:
    tasks = [t for s in month().sessions for t in s.tasks]
    assert len(tasks) == pytest.approx(30_909, rel=0.1)
    assert month().busy_gpu_hours() == pytest.approx(155_502, rel=0.2)
    assert max(t.submit_s for t in tasks) < 720 * 3600


def test_a_third_of_the_tasks_are_eight_gpus_wide() -> None:
    widths = Counter(t.gpus for s in month().sessions for t in s.tasks)
    total = sum(widths.values())
    for gpus, share in ((1, 0.49), (4, 0.20), (8, 0.31)):
        assert widths[gpus] / total == pytest.approx(share, abs=0.04)


def test_durations_and_think_times_have_the_measured_tails() -> None:
    durations = [t.duration_s for s in month().sessions for t in s.tasks]
    assert empirical_quantile(durations, 0.5) == pytest.approx(300, rel=TOLERANCE)
    assert empirical_quantile(durations, 0.99) == pytest.approx(17 * 3600, rel=TOLERANCE)
    gaps = [g for s in month().sessions for g in s.think_times()]
    assert empirical_quantile(gaps, 0.5) == pytest.approx(180, rel=TOLERANCE)
    assert empirical_quantile(gaps, 0.9) == pytest.approx(35 * 60, rel=TOLERANCE)
    assert sum(g > 3600 for g in gaps) / len(gaps) == pytest.approx(0.078, abs=0.01)


def test_same_seed_same_trace_and_the_cli_name_resolves() -> None:
    assert widetail(48, seed=3) == widetail(48, seed=3)
    assert widetail(48, seed=3) != widetail(48, seed=4)
    assert load_trace("synthetic:widetail", hours=48, seed=3) == widetail(48, seed=3)


@pytest.mark.parametrize("kwargs", [{"hours": 0}, {"hours": float("inf")},
                                    {"sessions_per_hour": 0}, {"mean_tasks": 0.5}])
def test_bad_arguments_are_refused_with_the_reason(kwargs: dict[str, float]) -> None:
    with pytest.raises(TraceError):
        widetail(**kwargs)
