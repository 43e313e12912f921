"""GPU job rules: outcome classification, retry verdicts, arguments, canaries, tiers."""

from __future__ import annotations

import json
import math
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.model.errors import InvalidInput
from nbfleet.model.jobs import (
    KILL_REASONS,
    MAX_ARGS_BYTES,
    AttemptEnd,
    CanaryRule,
    JobState,
    Next,
    Outcome,
    RetryRules,
    Verdict,
    after_attempt,
    argv,
    canary_bucket,
    check_args,
    classify,
    counts,
    input_fingerprint,
    parse_tiers,
    poison_hosts,
    retry_delay_s,
    routes_to_canary,
    should_roll_back,
)

RULES = RetryRules()  # base 2 s, cap 300 s, 5 infra retries, poison on 2 hosts


def end(outcome: Outcome, host: str | None = "h1") -> AttemptEnd:
    return AttemptEnd(outcome, host)


def verdict(*history: AttemptEnd, max_attempts: int = 3, cancel: bool = False,
            rules: RetryRules = RULES, jitter: float = 0.5) -> Verdict:
    return after_attempt(list(history), max_attempts, cancel_requested=cancel, rules=rules,
                         jitter=jitter)


# --- classify -------------------------------------------------------------------


@pytest.mark.parametrize(("reason", "expected"), [
    ("timeout", Outcome.TIMED_OUT),
    ("idle", Outcome.HANG),
    ("memory", Outcome.OOM),
    ("cancel", Outcome.CANCELLED),
    ("preempt", Outcome.PREEMPTED),
])
def test_the_agents_kill_reason_decides_whatever_the_exit_says(
        reason: str, expected: Outcome) -> None:
    assert classify(0, None, reason, has_output=True) is expected
    assert classify(None, signal.SIGKILL, reason, has_output=False) is expected
    assert classify(1, None, reason, has_output=False, output_tail="CUDA out of memory") \
        is expected


def test_every_kill_reason_is_mapped() -> None:
    assert {classify(None, signal.SIGTERM, r, False) for r in KILL_REASONS} == {
        Outcome.TIMED_OUT, Outcome.HANG, Outcome.OOM, Outcome.CANCELLED, Outcome.PREEMPTED}


@pytest.mark.parametrize("reason", ["oom", "Timeout", "", "kill"])
def test_unknown_kill_reason_is_rejected(reason: str) -> None:
    with pytest.raises(InvalidInput, match="unknown kill reason"):
        classify(None, signal.SIGKILL, reason, has_output=False)


def test_sigkill_nobody_sent_is_the_oom_killer() -> None:
    assert classify(None, signal.SIGKILL, None, has_output=True) is Outcome.OOM
    assert classify(None, int(signal.SIGKILL), None, has_output=False) is Outcome.OOM


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGTERM, signal.SIGABRT, signal.SIGBUS])
def test_any_other_signal_is_a_crash(sig: int) -> None:
    assert classify(None, sig, None, has_output=True) is Outcome.CRASH
    # ...even if the output mentions memory: only SIGKILL or an exit status counts.
    assert classify(None, sig, None, has_output=True, output_tail="MemoryError") \
        is Outcome.CRASH


def test_exit_zero_succeeds_only_with_output() -> None:
    assert classify(0, None, None, has_output=True) is Outcome.SUCCEEDED
    assert classify(0, None, None, has_output=False) is Outcome.NO_OUTPUT
    # A clean exit is not an OOM, whatever it printed on the way.
    assert classify(0, None, None, has_output=True, output_tail="out of memory, retrying on CPU") \
        is Outcome.SUCCEEDED


def test_exit_137_is_oom() -> None:
    assert classify(137, None, None, has_output=False) is Outcome.OOM


@pytest.mark.parametrize("tail", [
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: CUDA out of memory.",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "Traceback (most recent call last):\n  ...\nMemoryError",
    "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc",
    "RESOURCE_EXHAUSTED: OUT OF MEMORY while trying to allocate",
    "java.lang.OutOfMemoryError: Java heap space",
])
def test_out_of_memory_text_is_oom(tail: str) -> None:
    assert classify(1, None, None, has_output=False, output_tail=tail) is Outcome.OOM


@pytest.mark.parametrize(("code", "tail"), [
    (1, "Traceback (most recent call last):\nValueError: bad input"),
    (2, ""),
    (139, "Segmentation fault (core dumped)"),
    (255, "memory usage: 3 GiB"),
    (-1, "error"),
])
def test_other_failures_are_crashes(code: int, tail: str) -> None:
    assert classify(code, None, None, has_output=True, output_tail=tail) is Outcome.CRASH


# --- after_attempt ----------------------------------------------------------------


def test_success_is_done() -> None:
    assert verdict(end(Outcome.SUCCEEDED)) == Verdict(Next.DONE, JobState.SUCCEEDED, "succeeded")
    # Earlier failures do not matter once an attempt succeeds.
    assert verdict(end(Outcome.CRASH), end(Outcome.LOST, "h2"), end(Outcome.SUCCEEDED),
                   max_attempts=2).state is JobState.SUCCEEDED


@pytest.mark.parametrize("last", [o for o in Outcome if o != Outcome.SUCCEEDED])
def test_a_requested_cancel_wins_over_any_outcome_but_success(last: Outcome) -> None:
    history = [end(Outcome.CRASH), end(Outcome.CRASH, "h2"), end(last, "h3")]
    assert verdict(*history, max_attempts=1, cancel=True) == Verdict(
        Next.DONE, JobState.CANCELLED, "cancelled")


def test_a_cancel_that_loses_the_race_to_success_keeps_the_result() -> None:
    assert verdict(end(Outcome.SUCCEEDED), cancel=True) == Verdict(
        Next.DONE, JobState.SUCCEEDED, "succeeded")


def test_a_cancelled_attempt_is_cancelled_without_a_request() -> None:
    assert verdict(end(Outcome.CANCELLED)) == Verdict(Next.DONE, JobState.CANCELLED, "cancelled")


def test_preemption_requeues_now_and_is_never_charged() -> None:
    expected = Verdict(Next.REQUEUE, JobState.QUEUED, "preempted")
    assert verdict(end(Outcome.PREEMPTED), max_attempts=1) == expected
    assert verdict(*[end(Outcome.PREEMPTED, f"h{i}") for i in range(50)],
                   max_attempts=1) == expected
    # Preemptions between failures do not count towards max_attempts.
    history = [end(Outcome.CRASH), end(Outcome.PREEMPTED), end(Outcome.PREEMPTED),
               end(Outcome.CRASH)]
    v = verdict(*history, max_attempts=3)
    assert (v.next, v.state, v.reason) == (Next.RETRY, JobState.QUEUED, "crash")


def test_timeout_is_terminal_on_the_first_attempt() -> None:
    v = verdict(end(Outcome.TIMED_OUT), max_attempts=5)
    assert v == Verdict(Next.DONE, JobState.TIMED_OUT, "ran past its timeout (attempt 1)")
    v = verdict(end(Outcome.LOST), end(Outcome.TIMED_OUT, "h2"), max_attempts=5)
    assert v.state is JobState.TIMED_OUT and v.reason.endswith("(attempt 2)")
    assert not v.quarantined


def test_binary_failures_retry_with_growing_backoff_then_dead_letter() -> None:
    first = verdict(end(Outcome.CRASH))
    assert first == Verdict(Next.RETRY, JobState.QUEUED, "crash", delay_s=1.0)  # 2 * 2^0 * .5
    second = verdict(end(Outcome.CRASH), end(Outcome.OOM))
    assert second == Verdict(Next.RETRY, JobState.QUEUED, "oom", delay_s=2.0)  # 2 * 2^1 * .5
    third = verdict(end(Outcome.CRASH), end(Outcome.OOM), end(Outcome.HANG))
    assert third == Verdict(Next.DONE, JobState.DEAD_LETTERED,
                            "3 of 3 attempts failed (last: hang)")
    assert not third.quarantined


@pytest.mark.parametrize("outcome", [Outcome.CRASH, Outcome.OOM, Outcome.HANG,
                                     Outcome.NO_OUTPUT])
def test_each_binary_outcome_counts(outcome: Outcome) -> None:
    v = verdict(end(outcome), max_attempts=1)
    assert v.state is JobState.DEAD_LETTERED
    assert v.reason == f"1 of 1 attempts failed (last: {outcome})"


def test_infrastructure_failures_retry_beyond_max_attempts() -> None:
    lost = [end(Outcome.LOST, f"h{i}") for i in range(5)]
    for n in range(1, 6):
        v = verdict(*lost[:n], max_attempts=1)
        assert (v.next, v.state, v.reason) == (Next.RETRY, JobState.QUEUED, "lost")
        assert v.delay_s == retry_delay_s(n, RULES, 0.5)
        assert not v.quarantined
    sixth = verdict(*lost, end(Outcome.LAUNCH_FAILED, "h9"), max_attempts=1)
    assert sixth == Verdict(Next.DONE, JobState.DEAD_LETTERED,
                            "6 infrastructure failures (last: launch_failed)")


def test_no_infrastructure_retries_when_the_cap_is_zero() -> None:
    rules = RetryRules(max_infra_retries=0)
    assert verdict(end(Outcome.LOST), rules=rules).state is JobState.DEAD_LETTERED


def test_infrastructure_and_binary_failures_are_counted_apart() -> None:
    # Four infra failures do not use up a 2-attempt budget...
    history = [end(Outcome.CRASH), *[end(Outcome.LOST, "h1") for _ in range(4)]]
    assert verdict(*history, max_attempts=2).next is Next.RETRY
    # ...and a binary failure's backoff counts binary failures only.
    v = verdict(*history, end(Outcome.CRASH), max_attempts=3)
    assert v == Verdict(Next.RETRY, JobState.QUEUED, "crash", delay_s=2.0)
    v = verdict(*history, end(Outcome.CRASH), max_attempts=2)
    assert v.reason == "2 of 2 attempts failed (last: crash)"
    assert counts(history) == (1, 4)


def test_failing_on_two_hosts_before_max_attempts_quarantines_the_input() -> None:
    v = verdict(end(Outcome.CRASH, "h1"), end(Outcome.OOM, "h2"), max_attempts=5)
    assert v == Verdict(Next.DONE, JobState.DEAD_LETTERED,
                        "quarantined: the input failed on 2 hosts (last: oom)", quarantined=True)


def test_poison_host_count_is_configurable() -> None:
    rules = RetryRules(poison_hosts=3)
    two = [end(Outcome.CRASH, "h1"), end(Outcome.CRASH, "h2")]
    assert verdict(*two, max_attempts=5, rules=rules).next is Next.RETRY
    v = verdict(*two, end(Outcome.HANG, "h3"), max_attempts=5, rules=rules)
    assert v.quarantined and v.reason.startswith("quarantined: the input failed on 3 hosts")
    # poison_hosts=1: the first binary failure quarantines.
    assert verdict(end(Outcome.CRASH), rules=RetryRules(poison_hosts=1)).quarantined


def test_the_same_host_failing_again_is_not_poison() -> None:
    history = [end(Outcome.CRASH, "h1") for _ in range(4)]
    v = verdict(*history, max_attempts=5)
    assert (v.next, v.quarantined) == (Next.RETRY, False)
    assert poison_hosts(history) == {"h1"}


def test_infrastructure_failures_and_unknown_hosts_are_not_poison() -> None:
    history = [end(Outcome.CRASH, "h1"), end(Outcome.LOST, "h2"),
               end(Outcome.LAUNCH_FAILED, "h3"), end(Outcome.CRASH, None)]
    assert poison_hosts(history) == {"h1"}
    assert verdict(*history, max_attempts=5).next is Next.RETRY
    assert verdict(end(Outcome.CRASH, None), end(Outcome.CRASH, None)).next is Next.RETRY


def test_reaching_max_attempts_dead_letters_without_quarantine() -> None:
    """Poison is for inputs that fail *before* the budget runs out."""
    v = verdict(end(Outcome.CRASH, "h1"), end(Outcome.CRASH, "h2"), max_attempts=2)
    assert v == Verdict(Next.DONE, JobState.DEAD_LETTERED,
                        "2 of 2 attempts failed (last: crash)")


# --- backoff ------------------------------------------------------------------------


def test_retry_delay_is_full_jitter_of_an_exponential_ceiling() -> None:
    rules = RetryRules(backoff_base_s=2.0, backoff_cap_s=60.0)
    assert retry_delay_s(1, rules, 0.0) == 0.0
    assert retry_delay_s(1, rules, 0.5) == 1.0
    assert retry_delay_s(2, rules, 0.5) == 2.0
    assert retry_delay_s(4, rules, 0.5) == 8.0
    assert retry_delay_s(5, rules, 0.5) == 16.0
    assert retry_delay_s(6, rules, 0.5) == 30.0  # 64 capped at 60
    assert retry_delay_s(40, rules, 0.25) == 15.0
    assert retry_delay_s(0, rules, 0.5) == 1.0  # no negative exponent
    assert retry_delay_s(3, rules, 0.999) == pytest.approx(7.992)


@pytest.mark.parametrize("jitter", [1.0, -0.001, 1.5, math.nan, math.inf])
def test_jitter_outside_the_unit_interval_is_rejected(jitter: float) -> None:
    with pytest.raises(InvalidInput, match="jitter"):
        retry_delay_s(1, RULES, jitter)


@pytest.mark.parametrize("kwargs", [
    {"backoff_base_s": 10.0, "backoff_cap_s": 5.0},
    {"backoff_base_s": -1.0},
    {"backoff_cap_s": math.inf},
    {"backoff_base_s": math.nan},
    {"max_infra_retries": -1},
    {"poison_hosts": 0},
])
def test_bad_retry_rules_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidInput):
        RetryRules(**kwargs)  # type: ignore[arg-type]


def test_zero_backoff_is_allowed() -> None:
    assert retry_delay_s(7, RetryRules(backoff_base_s=0.0, backoff_cap_s=0.0), 0.9) == 0.0


@settings(max_examples=200, deadline=None)
@given(failures=st.integers(0, 1000), jitter=st.floats(0.0, 1.0, exclude_max=True),
       base=st.floats(0.0, 100.0), extra=st.floats(0.0, 10_000.0))
def test_delay_never_exceeds_the_capped_exponential(failures: int, jitter: float, base: float,
                                                    extra: float) -> None:
    rules = RetryRules(backoff_base_s=base, backoff_cap_s=base + extra)
    delay = retry_delay_s(failures, rules, jitter)
    ceiling = min(rules.backoff_cap_s, base * 2.0 ** max(0, failures - 1))
    assert 0.0 <= delay <= ceiling
    # More failures never shorten the wait for the same draw.
    assert retry_delay_s(failures + 1, rules, jitter) >= delay


# --- arguments ---------------------------------------------------------------------


def test_check_args_keeps_scalars() -> None:
    args = {"seed": 7, "scale": 0.5, "prompt": "a cat", "fast": True, "slow": False,
            "a-b_c9": "x"}
    assert check_args(args) == args
    assert check_args({}) == {}


def test_argv_flags_in_name_order_booleans_bare_false_omitted() -> None:
    args = check_args({"steps": 30, "prompt": "two words", "fp16": True, "cpu": False,
                       "guidance": 7.5, "zero": 0})
    assert argv(["python", "-m", "gen"], args, "/out/job-1") == [
        "python", "-m", "gen",
        "--fp16",
        "--guidance=7.5",
        "--prompt=two words",
        "--steps=30",
        "--zero=0",
        "--output-dir=/out/job-1",
    ]


def test_a_value_that_looks_like_a_flag_stays_a_value() -> None:
    line = argv(["g"], {"prompt": "--output-dir=/etc"}, "/o")
    assert line == ["g", "--prompt=--output-dir=/etc", "--output-dir=/o"]


def test_argv_without_args_only_adds_the_output_dir() -> None:
    command = ["/bin/gen"]
    assert argv(command, {}, "/o") == ["/bin/gen", "--output-dir=/o"]
    assert command == ["/bin/gen"]  # not mutated


def test_integer_one_is_not_a_boolean_flag() -> None:
    assert argv(["g"], {"n": 1, "m": 0}, "/o") == ["g", "--m=0", "--n=1", "--output-dir=/o"]


@pytest.mark.parametrize("name", [
    "", "Seed", "1seed", "-seed", "_seed", "se ed", "se.ed", "sééd", "a" * 64, "seed\n",
    "--seed", "seed=1",
])
def test_bad_argument_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidInput, match="argument name") as info:
        check_args({name: 1})
    assert info.value.extra == {"field": "args"}


def test_longest_argument_name_is_accepted() -> None:
    assert check_args({"a" * 63: 1}) == {"a" * 63: 1}


@pytest.mark.parametrize("name", ["output-dir", "output_dir"])
def test_output_dir_is_reserved(name: str) -> None:
    with pytest.raises(InvalidInput, match="set by nbfleet"):
        check_args({name: "/etc"})


@pytest.mark.parametrize("value", [None, [1, 2], {"a": 1}, (1,), b"bytes", {1}])
def test_non_scalar_values_are_rejected(value: object) -> None:
    with pytest.raises(InvalidInput, match="string, number or boolean"):
        check_args({"x": value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_rejected(value: float) -> None:
    with pytest.raises(InvalidInput, match="finite"):
        check_args({"x": value})


def test_nul_in_a_value_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="NUL"):
        check_args({"x": "a\x00b"})


def test_size_limit_is_exact() -> None:
    overhead = len(json.dumps({"a": ""}))  # {"a": ""}
    fits = "x" * (MAX_ARGS_BYTES - overhead)
    assert check_args({"a": fits}) == {"a": fits}
    with pytest.raises(InvalidInput, match="exceed"):
        check_args({"a": fits + "x"})


# --- fingerprints --------------------------------------------------------------------


def test_fingerprint_is_stable_and_ignores_argument_order() -> None:
    a = input_fingerprint("p1", "gen", "1.0", {"seed": 1, "prompt": "cat"})
    assert a == input_fingerprint("p1", "gen", "1.0", {"prompt": "cat", "seed": 1})
    assert len(a) == 64 and int(a, 16) >= 0


@pytest.mark.parametrize(("project", "binary", "version", "args"), [
    ("p2", "gen", "1.0", {"seed": 1, "prompt": "cat"}),
    ("p1", "gen2", "1.0", {"seed": 1, "prompt": "cat"}),
    ("p1", "gen", "1.1", {"seed": 1, "prompt": "cat"}),
    ("p1", "gen", "1.0", {"seed": 2, "prompt": "cat"}),
    ("p1", "gen", "1.0", {"seed": 1}),
    ("p1", "gen", "1.0", {"seed": True, "prompt": "cat"}),
    ("p1", "gen", "1.0", {"seed": 1.0, "prompt": "cat"}),
    ("p1", "gen", "1.0", {"seed": "1", "prompt": "cat"}),
])
def test_fingerprint_differs_per_project_binary_version_and_args(
        project: str, binary: str, version: str, args: dict[str, int | str]) -> None:
    base = input_fingerprint("p1", "gen", "1.0", {"seed": 1, "prompt": "cat"})
    assert input_fingerprint(project, binary, version, args) != base


# --- canary --------------------------------------------------------------------------


def test_canary_bucket_is_stable_and_in_range() -> None:
    buckets = [canary_bucket(f"job-{i}") for i in range(2000)]
    assert buckets == [canary_bucket(f"job-{i}") for i in range(2000)]
    assert min(buckets) == 0 and max(buckets) == 99


IDS = [f"job_{i:05d}" for i in range(10_000)]


def test_zero_percent_never_and_hundred_always() -> None:
    assert not any(routes_to_canary(j, 0) for j in IDS)
    assert all(routes_to_canary(j, 100) for j in IDS)


@pytest.mark.parametrize("percent", [1, 5, 10, 25, 50, 90])
def test_canary_share_is_close_to_the_percentage(percent: int) -> None:
    share = 100.0 * sum(routes_to_canary(j, percent) for j in IDS) / len(IDS)
    assert abs(share - percent) <= 2.0


def test_raising_the_percentage_keeps_earlier_canary_jobs() -> None:
    for j in IDS[:500]:
        routed = [routes_to_canary(j, p) for p in range(101)]
        assert routed == sorted(routed)  # False..False, True..True


def test_roll_back_needs_min_samples() -> None:
    rule = CanaryRule(failure_threshold=0.5, min_samples=5)
    assert not should_roll_back(rule, 4, 4)
    assert should_roll_back(rule, 5, 3)
    assert not should_roll_back(rule, 0, 0)


def test_roll_back_only_strictly_above_the_threshold() -> None:
    rule = CanaryRule(failure_threshold=0.5, min_samples=5)
    assert not should_roll_back(rule, 10, 5)
    assert should_roll_back(rule, 10, 6)
    assert not should_roll_back(rule, 10, 0)
    assert not should_roll_back(CanaryRule(1.0, 1), 10, 10)  # 100% never exceeds 1.0
    assert should_roll_back(CanaryRule(0.0, 1), 1, 1)
    assert not should_roll_back(CanaryRule(0.0, 1), 1, 0)


@pytest.mark.parametrize(("threshold", "min_samples"), [(-0.1, 5), (1.01, 5), (0.5, 0)])
def test_bad_canary_rules_are_rejected(threshold: float, min_samples: int) -> None:
    with pytest.raises(InvalidInput):
        CanaryRule(threshold, min_samples)


# --- tiers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "expected"), [
    ("free=0,paid=10", {"free": 0, "paid": 10}),
    (" free = 0 , paid=10 ,", {"free": 0, "paid": 10}),
    ("batch=-5", {"batch": -5}),
    ("a=1,,b=2", {"a": 1, "b": 2}),
    ("pro-tier_2=7", {"pro-tier_2": 7}),
])
def test_parse_tiers(spec: str, expected: dict[str, int]) -> None:
    assert parse_tiers(spec) == expected


@pytest.mark.parametrize("spec", ["free", "=1", "Free=1", "1st=1", "free=x", "free=1.5",
                                  "free=", "free=0,paid"])
def test_bad_tier_specs_are_rejected(spec: str) -> None:
    with pytest.raises(InvalidInput, match="invalid tier"):
        parse_tiers(spec)


@pytest.mark.parametrize("spec", ["", "  ", ",", " , "])
def test_at_least_one_tier(spec: str) -> None:
    with pytest.raises(InvalidInput, match="at least one tier"):
        parse_tiers(spec)
