"""Limits: parsing the flags, precedence of a project's own, how they are told."""

from __future__ import annotations

import pytest

from nbfleet.model.errors import InvalidInput
from nbfleet.model.limits import Limits, format_size, parse_size


def test_sizes_in_binary_and_si_units() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("10GB") == 10 * 1000**3
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096
    for bad in ("", "GiB", "4 parsecs", "-1GiB", "1e9"):
        with pytest.raises(InvalidInput, match="expected a number and a unit"):
            parse_size(bad)


def test_flags_parse_and_zero_or_none_means_unlimited() -> None:
    limits = Limits.parse("4GiB", "1", "512", "10GiB")
    assert limits == Limits(4 << 30, 1.0, 512, 10 << 30)
    assert Limits.parse("0", "none", "", None) == Limits()
    assert limits.describe() == "memory 4 GiB, 1 CPU, 512 processes, disk 10 GiB"


def test_limits_too_small_to_run_a_kernel_are_refused() -> None:
    with pytest.raises(InvalidInput, match="memory limit must be at least 64 MiB"):
        Limits.parse(memory="1MiB")
    with pytest.raises(InvalidInput, match="process limit"):
        Limits.parse(pids="3")
    with pytest.raises(InvalidInput, match="cpu limit"):
        Limits.parse(cpus="0.001")
    with pytest.raises(InvalidInput, match="invalid limit"):
        Limits.parse(pids="many")


def test_a_projects_own_limits_win_field_by_field() -> None:
    defaults = Limits(4 << 30, 1.0, 512, 10 << 30)
    mine = Limits(memory_bytes=8 << 30)
    assert defaults.over(mine) == Limits(8 << 30, 1.0, 512, 10 << 30)
    assert defaults.over(None) == defaults
    assert Limits.from_dict(defaults.as_dict()) == defaults


def test_sizes_are_told_the_way_they_were_given() -> None:
    assert format_size(4 << 30) == "4 GiB"
    assert format_size(3 << 29) == "1.5 GiB"
    assert format_size(100) == "100 B"
