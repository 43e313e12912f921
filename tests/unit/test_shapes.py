"""policy/shapes.py: which resource requests no host shape can ever satisfy, and why."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.resources import GpuGroup, HostInventory, parse_gpu_spec
from nbfleet.policy.shapes import UNBOUNDED, autoscaled_shape, unsatisfiable_reason


def shape(gpus: str, millicpus: int = 16_000, memory_mb: int = 65_536) -> HostInventory:
    return HostInventory(millicpus, memory_mb, parse_gpu_spec(gpus))


A100 = shape("1xA100-80GB")
V100S = shape("4xV100-16GB")
FLEET = [A100, V100S]


def test_a_request_some_host_holds_passes() -> None:
    assert unsatisfiable_reason(ResourceSpec(gpus=1, gpu_types=("A100-80GB",)), FLEET) is None
    assert unsatisfiable_reason(ResourceSpec(gpus=4, vram_gb=16), FLEET) is None
    assert unsatisfiable_reason(ResourceSpec(gpus=1, millicpus=16_000, memory_mb=65_536),
                                FLEET) is None


def test_missing_type_names_the_fleet_types() -> None:
    reason = unsatisfiable_reason(ResourceSpec(gpus=1, gpu_types=("H200-141GB",)), FLEET)
    assert reason is not None
    assert reason.startswith("no GPU type H200-141GB exists in the fleet "
                             "(types: A100-80GB, V100-16GB)")
    several = unsatisfiable_reason(
        ResourceSpec(gpus=1, gpu_types=("H200-141GB", "B200-192GB")), FLEET)
    assert several is not None and "none of the GPU types H200-141GB, B200-192GB" in several


def test_count_too_high_says_how_many_the_largest_fitting_host_has() -> None:
    reason = unsatisfiable_reason(ResourceSpec(gpus=2, gpu_types=("A100-80GB",), vram_gb=80),
                                  FLEET)
    assert reason == ("no host has 2 GPUs of type A100-80GB with at least 80 GB; the largest "
                      "fitting host has 1, and the autoscaler adds none")
    plain = unsatisfiable_reason(ResourceSpec(gpus=5), FLEET)
    assert plain == "no host has 5 GPUs; the largest has 4, and the autoscaler adds none"


def test_gpus_of_different_types_on_one_host_do_not_add_up() -> None:
    mixed = [shape("1xA100-80GB,1xH100-80GB")]
    reason = unsatisfiable_reason(ResourceSpec(gpus=2), mixed)
    assert reason is not None and "no host has 2 GPUs; the largest has 1" in reason


def test_vram_too_high_names_the_largest_gpu() -> None:
    reason = unsatisfiable_reason(ResourceSpec(gpus=1, vram_gb=96), FLEET)
    assert reason is not None
    assert reason.startswith("no GPU has at least 96 GB of VRAM; the largest has 80 GB")
    typed = unsatisfiable_reason(ResourceSpec(gpus=1, vram_gb=32, gpu_types=("V100-16GB",)),
                                 FLEET)
    assert typed is not None
    assert typed.startswith("no GPU of type V100-16GB has at least 32 GB of VRAM; the "
                            "largest has 16 GB")


def test_zero_gpus_pass_whatever_the_fleet() -> None:
    assert unsatisfiable_reason(ResourceSpec(), FLEET) is None
    assert unsatisfiable_reason(ResourceSpec(), []) is None
    assert unsatisfiable_reason(ResourceSpec(millicpus=1000, memory_mb=512), []) is None
    assert unsatisfiable_reason(ResourceSpec(millicpus=1000), [shape("")]) is None


def test_gpus_with_no_hosts_and_no_autoscaler_cannot_be_placed() -> None:
    reason = unsatisfiable_reason(ResourceSpec(gpus=1), [])
    assert reason is not None
    assert "no hosts are registered and the autoscaler adds none" in reason
    no_gpus = unsatisfiable_reason(ResourceSpec(gpus=1), [shape("")])
    assert no_gpus is not None and "the fleet has no GPUs" in no_gpus


def test_cpu_and_memory_are_limits_too() -> None:
    cpus = unsatisfiable_reason(ResourceSpec(millicpus=32_000), FLEET)
    assert cpus is not None and cpus.startswith("no host has 32 CPUs; the largest has 16 CPUs")
    memory = unsatisfiable_reason(ResourceSpec(memory_mb=128 * 1024), FLEET)
    assert memory is not None
    assert memory.startswith("no host has 128 GiB of memory; the largest has 64 GiB")


def test_every_part_fitting_some_host_is_not_enough() -> None:
    fleet = [shape("1xA100-80GB", millicpus=4000), shape("", millicpus=64_000)]
    reason = unsatisfiable_reason(ResourceSpec(gpus=1, millicpus=8000), fleet)
    assert reason is not None
    assert reason.startswith("no single host has 1 GPU together with 8 CPUs; the hosts with "
                             "1 GPU have at most 4 CPUs")
    split = [shape("", millicpus=64_000, memory_mb=1024), shape("", millicpus=1000)]
    both = unsatisfiable_reason(ResourceSpec(millicpus=8000, memory_mb=8192), split)
    assert both is not None and both.startswith("no single host has both 8 CPUs and 8 GiB")


@pytest.mark.parametrize("types", list(itertools.permutations(
    ("A100-80GB", "V100-16GB", "H200-141GB"))))
def test_preference_order_does_not_change_satisfiability(types: tuple[str, ...]) -> None:
    assert unsatisfiable_reason(ResourceSpec(gpus=4, gpu_types=types), FLEET) is None
    assert unsatisfiable_reason(ResourceSpec(gpus=1, vram_gb=40, gpu_types=types), FLEET) is None
    assert unsatisfiable_reason(ResourceSpec(gpus=5, gpu_types=types), FLEET) is not None


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 4), min_size=1, max_size=3), want=st.integers(1, 6),
       vram=st.sampled_from([0, 16, 40, 80]),
       types=st.lists(st.sampled_from(["A100-80GB", "V100-16GB", "H100-80GB"]),
                      max_size=3, unique=True))
def test_any_order_of_types_gives_the_same_verdict(counts: list[int], want: int, vram: int,
                                                   types: list[str]) -> None:
    names = ["A100-80GB", "V100-16GB", "H100-80GB"]
    fleet = [HostInventory(8000, 8192, (GpuGroup(n, names[i], int(names[i][5:-2])),))
             for i, n in enumerate(counts)]
    verdicts = {unsatisfiable_reason(ResourceSpec(gpus=want, vram_gb=vram,
                                                  gpu_types=tuple(order)), fleet) is None
                for order in itertools.permutations(types)}
    assert len(verdicts) == 1


def test_the_autoscaler_shape_is_counted() -> None:
    spec = ResourceSpec(gpus=8, gpu_types=("H100-80GB",))
    assert unsatisfiable_reason(spec, FLEET) is not None
    scaled = autoscaled_shape(parse_gpu_spec("8xH100-80GB"), FLEET)
    assert unsatisfiable_reason(spec, FLEET, autoscaled=scaled) is None
    # It also lets a GPU request through before any host has registered.
    alone = autoscaled_shape(parse_gpu_spec("8xH100-80GB"), [])
    assert unsatisfiable_reason(spec, [], autoscaled=alone) is None
    # What it cannot provide is still refused, and the reason says it was counted.
    bigger = unsatisfiable_reason(ResourceSpec(gpus=16), FLEET, autoscaled=scaled)
    assert bigger == ("no host has 16 GPUs; the largest has 8, counting the hosts the "
                      "autoscaler adds (8xH100-80GB)")


def test_autoscaled_hosts_have_the_largest_registered_cpu_and_memory() -> None:
    scaled = autoscaled_shape(parse_gpu_spec("1xA100-80GB"),
                              [shape("", millicpus=8000, memory_mb=1024),
                               shape("", millicpus=2000, memory_mb=4096)])
    assert (scaled.millicpus, scaled.memory_mb) == (8000, 4096)
    assert unsatisfiable_reason(ResourceSpec(gpus=1, millicpus=16_000), [],
                                autoscaled=scaled) is not None
    unknown = autoscaled_shape(parse_gpu_spec("1xA100-80GB"), [])
    assert unknown.millicpus == unknown.memory_mb == UNBOUNDED
    assert unsatisfiable_reason(ResourceSpec(gpus=1, millicpus=512_000), [],
                                autoscaled=unknown) is None
