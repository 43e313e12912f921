"""GPU prices per type and admission holds, in integer micro-credits."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.model.credits import MICRO, MS_PER_HOUR
from nbfleet.model.errors import InvalidInput
from nbfleet.model.pricing import DEFAULT, PriceTable, hold_amount, parse_prices

TABLE = parse_prices("default=1,A100-80GB=2.5,H100-80GB=4,L4=0.5")


# --- parse_prices -----------------------------------------------------------------


def test_decimal_credits_become_micro_credits() -> None:
    assert TABLE.rates == {"default": 1_000_000, "A100-80GB": 2_500_000,
                           "H100-80GB": 4_000_000, "L4": 500_000}


@pytest.mark.parametrize(("raw", "micro"), [
    ("0", 0),
    ("0.000001", 1),
    ("0.1", 100_000),  # exact in Decimal, unlike 0.1 as a float
    ("1.234567", 1_234_567),
    ("3.3", 3_300_000),
    ("1e3", 1_000_000_000),
    (" 2 ", 2_000_000),
])
def test_price_values(raw: str, micro: int) -> None:
    assert parse_prices(f"X={raw}").rates["X"] == micro


def test_default_is_one_credit_unless_given() -> None:
    assert parse_prices("A100-80GB=2").rates == {"A100-80GB": 2 * MICRO, DEFAULT: MICRO}
    assert parse_prices("").rates == {DEFAULT: MICRO}
    assert parse_prices("default=0.25").rates == {DEFAULT: 250_000}


def test_whitespace_and_empty_parts_are_ignored() -> None:
    assert parse_prices(" L4 = 0.5 , ,default=2,").rates == {"L4": 500_000, DEFAULT: 2 * MICRO}


@pytest.mark.parametrize(("spec", "match"), [
    ("A100", "expected TYPE=CREDITS"),
    ("=2", "expected TYPE=CREDITS"),
    (" =2", "expected TYPE=CREDITS"),
    ("A100=abc", "not a number"),
    ("A100=", "not a number"),
    ("A100=1,2", "expected TYPE=CREDITS"),
    ("A100=-1", "0 or more"),
    ("A100=-0.000001", "0 or more"),
    ("A100=NaN", "0 or more"),
    ("A100=inf", "0 or more"),
    ("A100=-Infinity", "0 or more"),
])
def test_bad_price_specs_are_rejected(spec: str, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse_prices(spec)


def test_price_table_needs_a_default_and_no_negatives() -> None:
    with pytest.raises(InvalidInput, match="default"):
        PriceTable({"A100": 1})
    with pytest.raises(InvalidInput, match="negative"):
        PriceTable({DEFAULT: 1, "A100": -1})


def test_rate_falls_back_to_default() -> None:
    assert TABLE.rate("H100-80GB") == 4_000_000
    assert TABLE.rate("T4") == 1_000_000


# --- dearest --------------------------------------------------------------------------


def test_dearest_among_preferred_types() -> None:
    assert TABLE.dearest(["A100-80GB", "H100-80GB"], ["L4"]) == ("H100-80GB", 4_000_000)
    assert TABLE.dearest(["L4", "A100-80GB"], ["H100-80GB"]) == ("A100-80GB", 2_500_000)
    # Known fleet types do not matter once the job names its types.
    assert TABLE.dearest(["L4"], ["H100-80GB", "A100-80GB"]) == ("L4", 500_000)


def test_a_preferred_type_without_a_price_costs_the_default() -> None:
    assert TABLE.dearest(["L4", "T4"], []) == ("T4", 1_000_000)


def test_any_type_is_priced_at_the_dearest_type_the_fleet_has() -> None:
    assert TABLE.dearest([], ["L4", "A100-80GB"]) == ("A100-80GB", 2_500_000)
    assert TABLE.dearest([], ["L4"]) == ("L4", 500_000)
    assert TABLE.dearest([], iter(["L4", "H100-80GB"])) == ("H100-80GB", 4_000_000)


def test_any_type_on_an_empty_fleet_is_priced_at_the_default() -> None:
    assert TABLE.dearest([], []) == (DEFAULT, 1_000_000)


def test_equal_rates_tie_break_on_the_name() -> None:
    table = parse_prices("default=1,a=2,b=2")
    assert table.dearest(["a", "b"], []) == ("b", 2 * MICRO)
    assert table.dearest(["b", "a"], []) == ("b", 2 * MICRO)


# --- hold_amount ---------------------------------------------------------------------


@pytest.mark.parametrize(("timeout_s", "gpus", "rate", "expected"), [
    (3600, 1, 4_000_000, 4_000_000),
    (3600, 2, 2_500_000, 5_000_000),
    (1800, 4, 1_000_000, 2_000_000),
    (1, 1, 1_000_000, 278),  # 1000 ms * 10^6 / 3.6e6 = 277.7..., rounded up
    (7200, 3, 1, 6),
    (1, 1, 1, 1),  # a sliver rounds up to one micro-credit
    (0, 1, 4_000_000, 1),  # a hold is never zero...
    (3600, 8, 0, 1),  # ...even for free GPUs
    (86_400, 8, 4_000_000, 768_000_000),
])
def test_hold_amount(timeout_s: int, gpus: int, rate: int, expected: int) -> None:
    assert hold_amount(timeout_s, gpus, rate) == expected


@settings(max_examples=200, deadline=None)
@given(timeout_s=st.integers(0, 30 * 86_400), gpus=st.integers(1, 64),
       rate=st.integers(0, 100 * MICRO))
def test_hold_is_the_exact_cost_rounded_up(timeout_s: int, gpus: int, rate: int) -> None:
    exact = Fraction(timeout_s * 1000 * gpus * rate, MS_PER_HOUR)
    held = hold_amount(timeout_s, gpus, rate)
    assert held >= 1
    assert held >= exact
    assert held < exact + 1 or held == 1
    assert isinstance(held, int)
