"""GPU inventory specs as an agent declares them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbfleet.model.errors import InvalidInput
from nbfleet.model.resources import GpuGroup, HostInventory, parse_gpu_spec


def test_parses_several_groups() -> None:
    assert parse_gpu_spec("4xA100-80GB,2xH100-80GB") == (
        GpuGroup(4, "A100-80GB", 80),
        GpuGroup(2, "H100-80GB", 80),
    )


def test_tolerates_spaces_and_stray_commas() -> None:
    assert parse_gpu_spec(" 1xL4-24GB , ,8xH200-141GB,") == (
        GpuGroup(1, "L4-24GB", 24),
        GpuGroup(8, "H200-141GB", 141),
    )


@pytest.mark.parametrize("spec", ["", " ", ",", " , "])
def test_empty_spec_declares_no_gpus(spec: str) -> None:
    assert parse_gpu_spec(spec) == ()


@pytest.mark.parametrize(
    "bad",
    [
        "4A100-80GB",
        "xA100-80GB",
        "4xA100",
        "4xA100-80",
        "4xA100-80gb",
        "4xA 100-80GB",
        "4x-80GB",
        "-1xA100-80GB",
        "4.5xA100-80GB",
        "4xA100-80GB;2xH100-80GB",
        "four x A100",
    ],
)
def test_rejects_malformed_part_and_names_it(bad: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_gpu_spec(bad)
    assert repr(bad) in info.value.detail
    assert info.value.status == 422


def test_names_only_the_bad_part() -> None:
    with pytest.raises(InvalidInput) as info:
        parse_gpu_spec("4xA100-80GB,bogus,2xH100-80GB")
    assert "'bogus'" in info.value.detail
    assert "4xA100-80GB'" not in info.value.detail


@pytest.mark.parametrize("zero", ["0xA100-80GB", "00xH100-80GB", "2xL4-24GB,0xA100-80GB"])
def test_rejects_zero_count(zero: str) -> None:
    with pytest.raises(InvalidInput, match="at least 1") as info:
        parse_gpu_spec(zero)
    assert "0x" in info.value.detail


@st.composite
def gpu_groups(draw: st.DrawFn) -> GpuGroup:
    model = draw(st.from_regex(r"[A-Za-z0-9]{1,12}", fullmatch=True))
    vram = draw(st.integers(min_value=0, max_value=100_000))
    return GpuGroup(draw(st.integers(min_value=1, max_value=10_000)), f"{model}-{vram}GB", vram)


groups_st = st.lists(gpu_groups(), max_size=6)


@given(groups=groups_st)
def test_labels_round_trip(groups: list[GpuGroup]) -> None:
    spec = ",".join(group.label for group in groups)
    assert parse_gpu_spec(spec) == tuple(groups)


def test_inventory_gpu_count() -> None:
    inventory = HostInventory(16_000, 65_536, parse_gpu_spec("4xA100-80GB,2xH100-80GB"))
    assert inventory.gpu_count == 6
    assert HostInventory(1000, 1024).gpu_count == 0
