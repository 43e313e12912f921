"""The shape of the NotebookOS paper's results (section 5.3), on our synthetic Sensei trace.

These are the claims ``docs/simulation.md`` makes; each could fail if a policy or
the simulator regressed. Three seeds, so no claim rests on one lucky trace.
"""

from __future__ import annotations

import pytest

from nbfleet.sim.compare import run_policies
from nbfleet.sim.traces.synthetic import sensei


@pytest.fixture(scope="module", params=[0, 1, 2])
def results(request: pytest.FixtureRequest) -> dict:
    trace = sensei(17.5, request.param)
    runs = run_policies(trace, ["reservation", "batch", "notebookos", "lcp", "nbfleet"])
    return {name: run.summary for name, run in runs.items()}


def test_reservation_is_most_interactive_at_the_most_gpu_hours(results: dict) -> None:
    reservation = results["reservation"]
    others = [s for name, s in results.items() if name != "reservation"]
    assert all(reservation.gpu_hours_provisioned > s.gpu_hours_provisioned for s in others)
    for name in ("batch", "lcp", "notebookos"):
        assert reservation.immediate_fraction >= results[name].immediate_fraction, name
    assert reservation.immediate_fraction > 0.98


def test_batch_is_cheapest_and_least_interactive(results: dict) -> None:
    batch = results["batch"]
    others = [s for name, s in results.items() if name != "batch"]
    assert all(batch.gpu_hours_provisioned < s.gpu_hours_provisioned for s in others)
    assert all(batch.delay_p50_s > s.delay_p50_s for s in others)
    assert batch.immediate_fraction == 0.0  # every task waits for a new container


def test_notebookos_saves_most_gpu_hours_and_starts_most_tasks_at_once(results: dict) -> None:
    notebookos, reservation = results["notebookos"], results["reservation"]
    assert notebookos.gpu_hours_provisioned < 0.6 * reservation.gpu_hours_provisioned
    assert notebookos.immediate_fraction > 0.9  # the paper: 89.6 %


def test_lcp_sits_between_batch_and_notebookos(results: dict) -> None:
    lcp = results["lcp"]
    assert (results["batch"].gpu_hours_provisioned < lcp.gpu_hours_provisioned
            < results["notebookos"].gpu_hours_provisioned)
    assert results["notebookos"].delay_p50_s < lcp.delay_p50_s < results["batch"].delay_p50_s


def test_nbfleet_uses_fewer_gpu_hours_than_notebookos(results: dict) -> None:
    nbfleet, notebookos = results["nbfleet"], results["notebookos"]
    assert nbfleet.gpu_hours_provisioned < 0.95 * notebookos.gpu_hours_provisioned
    assert nbfleet.immediate_fraction >= notebookos.immediate_fraction - 0.005
