"""Rollout without collateral, the pure rules: whose an attempt that failed on a
canary is (``charge``), and what the job does next (``after_attempt``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.model.jobs import (
    BLAME,
    AttemptEnd,
    Blame,
    Charge,
    JobState,
    Next,
    Outcome,
    RetryRules,
    Verdict,
    VersionState,
    after_attempt,
    charge,
    counts,
    poison_hosts,
)

RULES = RetryRules()
BINARY = [o for o in Outcome if BLAME[o] == Blame.BINARY]
NOT_BINARY = [o for o in Outcome if BLAME[o] != Blame.BINARY]


def end(outcome: Outcome, host: str = "h1", who: Charge = Charge.JOB) -> AttemptEnd:
    return AttemptEnd(outcome, host, who)


def verdict(*history: AttemptEnd, max_attempts: int = 3, cancel: bool = False) -> Verdict:
    return after_attempt(list(history), max_attempts, cancel_requested=cancel, rules=RULES,
                         jitter=0.5)


# --- charge -----------------------------------------------------------------------


@pytest.mark.parametrize("outcome", BINARY)
def test_a_binary_failure_on_a_canary_is_not_the_unpinned_job_s(outcome: Outcome) -> None:
    assert charge(outcome, False, VersionState.CANARY, True) is Charge.CANARY
    assert charge(outcome, False, VersionState.ROLLED_BACK, True) is Charge.ROLLED_BACK
    assert charge(outcome, False, "rolled_back", True) is Charge.ROLLED_BACK  # a DB string


@pytest.mark.parametrize("outcome", BINARY)
@pytest.mark.parametrize("state", [VersionState.STABLE, VersionState.RETIRED, None])
def test_a_failure_on_a_stable_or_promoted_version_is_the_job_s(
        outcome: Outcome, state: VersionState | None) -> None:
    # A promoted canary is stable (or retired, after a later promotion): its
    # failures become the job's; an unknown version protects nobody.
    assert charge(outcome, False, state, True) is Charge.JOB


@pytest.mark.parametrize("outcome", BINARY)
def test_a_pinned_job_chose_its_version(outcome: Outcome) -> None:
    for state in VersionState:
        assert charge(outcome, True, state, True) is Charge.JOB


@pytest.mark.parametrize("outcome", NOT_BINARY)
def test_only_binary_failures_are_taken_off_the_job(outcome: Outcome) -> None:
    # Infrastructure failures have their own cap; successes, cancels and
    # preemptions are never counted anyway.
    assert charge(outcome, False, VersionState.CANARY, True) is Charge.JOB


def test_with_no_stable_version_to_fall_back_to_the_failure_is_the_job_s() -> None:
    """Otherwise the job would retry the same canary, uncounted, forever."""
    assert charge(Outcome.CRASH, False, VersionState.CANARY, False) is Charge.JOB


# --- after_attempt ----------------------------------------------------------------


@pytest.mark.parametrize("outcome", BINARY)
@pytest.mark.parametrize("who", [Charge.CANARY, Charge.ROLLED_BACK])
def test_a_canary_s_failure_falls_back_to_stable_even_on_the_last_attempt(
        outcome: Outcome, who: Charge) -> None:
    v = verdict(end(outcome, who=who), max_attempts=1)
    assert (v.next, v.state, v.delay_s, v.quarantined) == (Next.FALL_BACK, JobState.QUEUED,
                                                           0.0, False)
    assert v.reason.startswith(f"{outcome} on a ") and "not counted" in v.reason
    assert ("rolled-back" in v.reason) == (who is Charge.ROLLED_BACK)


def test_a_timeout_on_a_canary_is_not_final() -> None:
    assert verdict(end(Outcome.TIMED_OUT, who=Charge.CANARY)).next is Next.FALL_BACK
    assert verdict(end(Outcome.TIMED_OUT)).state is JobState.TIMED_OUT


def test_a_cancel_still_wins() -> None:
    assert verdict(end(Outcome.CRASH, who=Charge.CANARY), cancel=True).state \
        is JobState.CANCELLED


def test_canary_failures_count_neither_against_attempts_nor_as_poison() -> None:
    canary = [end(Outcome.CRASH, "h1", Charge.CANARY), end(Outcome.OOM, "h2", Charge.ROLLED_BACK)]
    assert counts(canary) == (0, 0) and poison_hosts(canary) == set()
    # One attempt of the job's own after two on the canary, on a third host: a
    # plain retry, not "3 of 3", not quarantined.
    v = verdict(*canary, end(Outcome.CRASH, "h3"), max_attempts=2)
    assert v == Verdict(Next.RETRY, JobState.QUEUED, "crash", delay_s=1.0)
    assert verdict(*canary, end(Outcome.CRASH, "h3"), max_attempts=1).reason \
        == "1 of 1 attempts failed (last: crash)"


def _histories() -> st.SearchStrategy[list[AttemptEnd]]:
    own = st.builds(AttemptEnd, st.sampled_from(list(Outcome)),
                    st.sampled_from(["h1", "h2", "h3"]), st.just(Charge.JOB))
    return st.lists(own, min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(history=_histories(), max_attempts=st.integers(1, 5),
       inserted=st.lists(st.tuples(st.integers(0, 8), st.sampled_from(BINARY),
                                   st.sampled_from(["h1", "h2", "h3", "h4"]),
                                   st.sampled_from([Charge.CANARY, Charge.ROLLED_BACK])),
                         max_size=4))
def test_failures_charged_to_the_rollout_change_no_verdict(
        history: list[AttemptEnd], max_attempts: int,
        inserted: list[tuple[int, Outcome, str, Charge]]) -> None:
    """Slipping canary failures anywhere before the last attempt decides nothing:
    the job's own attempts alone say whether it retries, when, and whether it is
    dead-lettered or quarantined."""
    *earlier, last = history
    longer = list(earlier)
    for at, outcome, host, who in inserted:
        longer.insert(min(at, len(longer)), AttemptEnd(outcome, host, who))
    plain = verdict(*earlier, last, max_attempts=max_attempts)
    mixed = verdict(*longer, last, max_attempts=max_attempts)
    assert (mixed.next, mixed.state, mixed.delay_s, mixed.quarantined) == (
        plain.next, plain.state, plain.delay_s, plain.quarantined)
    if plain.state is not JobState.TIMED_OUT:  # its reason names the attempt's number
        assert mixed.reason == plain.reason
