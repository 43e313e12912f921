"""Workspace lifecycle: state table, API request rules, reconciler plan, backoff."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbfleet.model.errors import Conflict
from nbfleet.model.workspace import (
    SETTLED,
    TRANSITIONS,
    Action,
    DesiredState,
    Step,
    WorkspaceState,
    check_request,
    check_transition,
    is_settled,
    plan,
    retry_delay_s,
)

S = WorkspaceState
D = DesiredState

ALL_PAIRS = [(state, desired) for state in S for desired in D]
GONE = frozenset({S.DELETING, S.DELETED})

states = st.sampled_from(list(S))
desireds = st.sampled_from(list(D))


def _unreachable(state: WorkspaceState, desired: DesiredState) -> bool:
    """Only a delete can make progress once deletion has started."""
    return desired is not D.DELETED and state in GONE


# --------------------------------------------------------------------------- table


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(S)
    for targets in TRANSITIONS.values():
        assert targets <= set(S)


def test_deleted_is_terminal_and_deleting_only_finishes() -> None:
    assert TRANSITIONS[S.DELETED] == frozenset()
    assert TRANSITIONS[S.DELETING] == frozenset({S.DELETED})


def test_every_state_except_deleted_can_start_deleting() -> None:
    for state in S:
        if state in GONE:
            continue
        check_transition(state, S.DELETING)


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (S.DELETED, S.RUNNING),
        (S.DELETED, S.DELETING),
        (S.DELETING, S.RUNNING),
        (S.DELETING, S.FAILED),
        (S.SUSPENDED, S.RUNNING),  # must pass through resuming
        (S.SUSPENDED, S.FAILED),
        (S.CREATING, S.SUSPENDED),  # must pass through suspending
        (S.RUNNING, S.RUNNING),
        (S.SUSPENDING, S.SUSPENDING),
    ],
)
def test_check_transition_refuses_illegal_moves(current: S, new: S) -> None:
    with pytest.raises(Conflict) as info:
        check_transition(current, new)
    assert info.value.status == 409
    assert info.value.extra["current_state"] == str(current)
    assert str(current) in info.value.detail and str(new) in info.value.detail


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (S.CREATING, S.RUNNING),
        (S.RUNNING, S.SUSPENDING),
        (S.SUSPENDING, S.SUSPENDED),
        (S.SUSPENDED, S.RESUMING),
        (S.RESUMING, S.RUNNING),
        (S.FAILED, S.RESUMING),
        (S.DELETING, S.DELETED),
    ],
)
def test_check_transition_allows_legal_moves(current: S, new: S) -> None:
    check_transition(current, new)  # does not raise


# ------------------------------------------------------------------------- requests


@pytest.mark.parametrize("current", sorted(GONE))
@pytest.mark.parametrize("desired", [D.RUNNING, D.SUSPENDED])
def test_check_request_refuses_suspend_resume_once_deleting(current: S, desired: D) -> None:
    with pytest.raises(Conflict) as info:
        check_request(current, desired)
    assert info.value.status == 409
    assert info.value.extra["current_state"] == current.value
    assert current.value in info.value.detail


@pytest.mark.parametrize("current", sorted(set(S) - GONE))
@pytest.mark.parametrize("desired", [D.RUNNING, D.SUSPENDED])
def test_check_request_accepts_suspend_resume_otherwise(current: S, desired: D) -> None:
    check_request(current, desired)


@pytest.mark.parametrize("current", list(S))
def test_check_request_always_accepts_delete(current: S) -> None:
    check_request(current, D.DELETED)
    check_request(current, D.DELETED, D.DELETED)  # a repeat


@pytest.mark.parametrize("current", sorted(set(S) - GONE))
@pytest.mark.parametrize("desired", [D.RUNNING, D.SUSPENDED])
def test_a_requested_delete_is_final_before_the_reconciler_begins_it(current: S,
                                                                     desired: D) -> None:
    """A resume arriving before the reconciler's next pass must not undo a delete
    (it used to, when the machine was slow enough: test_idempotency saw it in CI)."""
    with pytest.raises(Conflict, match="being deleted") as info:
        check_request(current, desired, D.DELETED)
    assert info.value.extra["current_state"] == current.value
    check_request(current, desired, D.RUNNING)
    check_request(current, desired, D.SUSPENDED)


def test_check_request_names_the_verb() -> None:
    with pytest.raises(Conflict, match="suspend"):
        check_request(S.DELETED, D.SUSPENDED)
    with pytest.raises(Conflict, match="resume"):
        check_request(S.DELETING, D.RUNNING)


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize(("current", "desired"), ALL_PAIRS)
def test_every_planned_step_is_legal(current: S, desired: D) -> None:
    step = plan(current, desired)
    if step is None:
        return
    state = current
    if step.enter is not None:
        assert step.done in TRANSITIONS[step.enter], step
        check_transition(state, step.enter)
        state = step.enter
    check_transition(state, step.done)


@pytest.mark.parametrize(("current", "desired"), ALL_PAIRS)
def test_plan_is_none_exactly_when_settled_or_unreachable(current: S, desired: D) -> None:
    step = plan(current, desired)
    expect_none = is_settled(current, desired) or _unreachable(current, desired)
    assert (step is None) == expect_none
    if step is not None:
        assert step.done == SETTLED[desired] or step.done is S.SUSPENDED


@pytest.mark.parametrize(("current", "desired"), ALL_PAIRS)
def test_replanning_from_entered_state_resumes_the_same_step(current: S, desired: D) -> None:
    """A crash after writing ``enter`` re-runs the same step without entering again."""
    step = plan(current, desired)
    if step is None or step.enter is None:
        return
    assert plan(step.enter, desired) == dataclasses.replace(step, enter=None)


def test_plan_examples() -> None:
    assert plan(S.RUNNING, D.RUNNING) is None
    assert plan(S.SUSPENDED, D.SUSPENDED) is None
    assert plan(S.DELETED, D.DELETED) is None
    assert plan(S.CREATING, D.RUNNING) == Step(Action.PLACE, S.RUNNING)
    assert plan(S.SUSPENDED, D.RUNNING) == Step(Action.PLACE, S.RUNNING, S.RESUMING)
    assert plan(S.FAILED, D.RUNNING) == Step(Action.PLACE, S.RUNNING, S.RESUMING)
    assert plan(S.RUNNING, D.SUSPENDED) == Step(Action.RELEASE, S.SUSPENDED, S.SUSPENDING)
    assert plan(S.RUNNING, D.DELETED) == Step(Action.DESTROY, S.DELETED, S.DELETING)
    assert plan(S.DELETING, D.DELETED) == Step(Action.DESTROY, S.DELETED)
    assert plan(S.DELETING, D.RUNNING) is None
    assert plan(S.DELETED, D.SUSPENDED) is None


def test_suspension_in_flight_finishes_before_resume() -> None:
    assert plan(S.SUSPENDING, D.RUNNING) == Step(Action.RELEASE, S.SUSPENDED)


def test_delete_always_destroys() -> None:
    for state in S:
        step = plan(state, D.DELETED)
        if state is S.DELETED:
            assert step is None
        else:
            assert step is not None and step.action is Action.DESTROY


# ---------------------------------------------------------------- reconciler model


def _apply(state: S, step: Step, crash: bool) -> tuple[S, bool]:
    """Write ``enter`` then ``done``, each checked; a crash loses the ``done`` write."""
    if step.enter is not None:
        check_transition(state, step.enter)
        state = step.enter
        if crash:
            return state, True
    check_transition(state, step.done)
    return step.done, False


@given(start=states, desired=desireds, crashes=st.lists(st.booleans(), max_size=12))
def test_reconciler_converges_despite_crashes(
    start: S, desired: D, crashes: list[bool]
) -> None:
    state = start
    pending_crashes = list(crashes)
    plans = crashed = 0
    while (step := plan(state, desired)) is not None:
        plans += 1
        assert plans <= 2 + len(crashes), "reconciler does not converge"
        crash = pending_crashes.pop(0) if pending_crashes else False
        state, did_crash = _apply(state, step, crash)
        crashed += did_crash
    # Each step needs at most two writes; only a crash between them costs a re-plan.
    assert plans <= 2 + crashed
    if _unreachable(start, desired):
        assert state == start
    else:
        assert state == SETTLED[desired]
        assert is_settled(state, desired)


requests = st.one_of(st.none(), desireds)
events = st.tuples(st.booleans(), requests)


@given(start=states, desired=desireds, history=st.lists(events, max_size=30))
def test_reconciler_converges_after_user_flips(
    start: S, desired: D, history: list[tuple[bool, D | None]]
) -> None:
    if start in GONE:
        desired = D.DELETED  # the API refuses anything else by then
    state = start
    seen: list[S] = [state]

    def request(new: D | None) -> None:
        nonlocal desired
        if new is None:
            return
        try:
            check_request(state, new)
        except Conflict as exc:
            assert state in GONE
            assert exc.extra["current_state"] == state.value
            return
        desired = new

    for crash, new in history:
        step = plan(state, desired)
        if step is None:
            request(new)
            continue
        # The request lands while the step is in flight, between its two writes.
        if step.enter is not None:
            check_transition(state, step.enter)
            state = step.enter
            seen.append(state)
        request(new)
        if crash:
            continue
        check_transition(state, step.done)
        state = step.done
        seen.append(state)

    for _ in range(3):  # flips stopped: at most two steps remain
        step = plan(state, desired)
        if step is None:
            break
        state, _ = _apply(state, step, crash=False)
        seen.append(state)
    assert plan(state, desired) is None
    assert state == SETTLED[desired]

    if S.DELETED in seen:
        first = seen.index(S.DELETED)
        assert all(s is S.DELETED for s in seen[first:])
    if S.DELETING in seen:
        first = seen.index(S.DELETING)
        assert all(s in GONE for s in seen[first:])
        assert state is S.DELETED


# -------------------------------------------------------------------------- backoff


def test_retry_delay_doubles_from_base() -> None:
    assert retry_delay_s(1) == 1.0
    assert retry_delay_s(2) == 2.0
    assert retry_delay_s(3) == 4.0
    assert retry_delay_s(5) == 16.0
    assert retry_delay_s(3, base_s=0.5) == 2.0


def test_retry_delay_before_first_attempt_is_base() -> None:
    assert retry_delay_s(0) == 1.0
    assert retry_delay_s(-3, base_s=2.0) == 2.0


def test_retry_delay_is_capped() -> None:
    assert retry_delay_s(9) == 256.0
    assert retry_delay_s(10) == 300.0
    assert retry_delay_s(50) == 300.0
    assert retry_delay_s(4, cap_s=5.0) == 5.0


def test_retry_delay_survives_a_huge_attempt_count() -> None:
    # Regression: 2 ** 1024 does not fit a float and used to raise OverflowError,
    # which a workspace failing for a few days at the 300 s cap would hit.
    assert retry_delay_s(1025) == 300.0
    assert retry_delay_s(10**6) == 300.0


@given(
    attempts=st.integers(min_value=0, max_value=10**5),
    base=st.floats(min_value=0.01, max_value=60),
    cap=st.floats(min_value=1, max_value=3600),
)
def test_retry_delay_is_monotonic_and_bounded(attempts: int, base: float, cap: float) -> None:
    delay = retry_delay_s(attempts, base_s=base, cap_s=cap)
    following = retry_delay_s(attempts + 1, base_s=base, cap_s=cap)
    assert isinstance(delay, float)
    assert min(base, cap) <= delay <= cap
    assert delay <= following
    if following < cap:
        assert following == pytest.approx(2 * delay) or attempts == 0
