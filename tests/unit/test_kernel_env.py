"""Which variables of a gateway client's kernel start request reach a kernel: only
``KERNEL_*``, short, printable and few; hostile ones never."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbfleet.model.errors import InvalidInput
from nbfleet.protocol.kernel_env import MAX_ENTRIES, MAX_VALUE_CHARS, NAME, allowed_kernel_env


def test_what_jupyter_server_sends_passes() -> None:
    env = {"KERNEL_USERNAME": "ada", "KERNEL_WORKING_DIR": "/home/ada/notebooks",
           "KERNEL_LAUNCH_TIMEOUT": "40"}
    assert allowed_kernel_env(env) == env
    assert allowed_kernel_env(None) == {} and allowed_kernel_env({}) == {}


@pytest.mark.parametrize("name", [
    "LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME",
    "BASH_ENV", "ENV", "HOME", "NBFLEET_STATE_DIR", "PIP_TARGET", "CUDA_VISIBLE_DEVICES",
    "kernel_x", "Kernel_X", "KERNEL_", "KERNEL_x", "KERNEL_A-B", "KERNEL_A B", "KERNEL_A.B",
    "KERNEL_X\n", "\nKERNEL_X", "KERNEL_X\0", " KERNEL_X", "XKERNEL_X", "KERNEL_\u0130",
    "KERNEL_" + "A" * 65,
])
def test_hostile_or_foreign_names_are_dropped(name: str) -> None:
    assert allowed_kernel_env({name: "/tmp/evil.so", "KERNEL_OK": "1"}) == {"KERNEL_OK": "1"}


def test_the_longest_name_passes() -> None:
    name = "KERNEL_" + "A" * 64
    assert allowed_kernel_env({name: "v"}) == {name: "v"}


@pytest.mark.parametrize("value", [
    "x" * (MAX_VALUE_CHARS + 1), "x" * 1_000_000, "a\0b", "\ud800",
])
def test_values_too_long_or_not_storable_are_dropped(value: str) -> None:
    assert allowed_kernel_env({"KERNEL_BIG": value, "KERNEL_OK": ""}) == {"KERNEL_OK": ""}


def test_values_up_to_the_limit_pass_whatever_they_hold() -> None:
    env = {"KERNEL_A": "x" * MAX_VALUE_CHARS, "KERNEL_B": "line\nbreak '\"; $(rm -rf /)",
           "KERNEL_C": "h\u00e9\u4e2d\U0001f600"}
    assert allowed_kernel_env(env) == env


def test_at_most_32_entries_pass() -> None:
    env = {f"KERNEL_V{i}": str(i) for i in range(1000)}
    allowed = allowed_kernel_env(env)
    assert len(allowed) == MAX_ENTRIES == 32
    assert allowed == {f"KERNEL_V{i}": str(i) for i in range(32)}  # the first ones, in order


def test_dropped_entries_do_not_count_against_the_limit() -> None:
    env = {**{f"LD_X{i}": "x" for i in range(100)}, "KERNEL_LATE": "1"}
    assert allowed_kernel_env(env) == {"KERNEL_LATE": "1"}


@pytest.mark.parametrize("env", [
    "KERNEL_X=1", ["KERNEL_X"], 5, {"KERNEL_X": 1}, {"KERNEL_X": None}, {"KERNEL_X": ["a"]},
    {1: "x"}, {"KERNEL_X": {"nested": "x"}},
])
def test_an_env_that_is_not_strings_is_refused_clearly(env: object) -> None:
    with pytest.raises(InvalidInput, match="env must be") as refused:
        allowed_kernel_env(env)
    assert refused.value.status == 422


@given(st.dictionaries(st.text(max_size=80), st.text(max_size=5000), max_size=60))
def test_whatever_passes_is_a_kernel_variable(env: dict[str, str]) -> None:
    allowed = allowed_kernel_env(env)
    assert len(allowed) <= MAX_ENTRIES
    for name, value in allowed.items():
        assert NAME.fullmatch(name) and name.isascii() and env[name] == value
        assert len(value) <= MAX_VALUE_CHARS and "\0" not in value
        value.encode("utf-8")
