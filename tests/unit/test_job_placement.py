"""Placing jobs on heterogeneous hosts through the free-GPU index."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nbfleet.model.cluster import Gpu, Host, ResourceSpec
from nbfleet.model.errors import Conflict
from nbfleet.policy.job_placement import FreeGpus, Placement

A100, H100, L4 = "A100", "H100", "L4"


def host(host_id: str, *groups: tuple[int, str, int]) -> Host:
    """A host from (count, type, VRAM GB) groups, GPU indices in order."""
    gpus: list[Gpu] = []
    for count, gpu_type, vram in groups:
        gpus += [Gpu(len(gpus) + i, gpu_type, vram) for i in range(count)]
    return Host(host_id, 8000, 64_000, gpus)


def spec(gpus: int = 1, *types: str, vram: int = 0) -> ResourceSpec:
    return ResourceSpec(gpus=gpus, vram_gb=vram, gpu_types=types)


def where(index: FreeGpus, s: ResourceSpec, avoid: Collection[str] = ()) -> str | None:
    placement = index.place(s, avoid)
    return None if placement is None else placement.host_id


def fill(index: FreeGpus, host_id: str, holder: str, count: int) -> None:
    """Bind the host's first ``count`` free GPUs to ``holder`` through the index."""
    gpus = index.hosts[host_id].free_gpus()[:count]
    index.commit(holder, Placement(host_id, tuple(gpus)))


# --- types and VRAM -------------------------------------------------------------------


def test_types_are_tried_in_the_jobs_order_of_preference() -> None:
    index = FreeGpus([host("a", (4, A100, 80)), host("h", (4, H100, 80))])
    assert where(index, spec(1, H100, A100)) == "h"
    assert where(index, spec(1, A100, H100)) == "a"
    fill(index, "h", "other", 4)
    assert where(index, spec(1, H100, A100)) == "a"
    assert where(index, spec(1, H100)) is None


def test_preference_beats_best_fit() -> None:
    """A nearly full host of a later-preferred type does not win over the first type."""
    index = FreeGpus([host("a", (1, A100, 80)), host("h", (8, H100, 80))])
    assert where(index, spec(1, H100, A100)) == "h"


def test_without_preference_the_smallest_vram_that_fits_wins() -> None:
    index = FreeGpus([host("big", (2, H100, 80)), host("small", (2, L4, 24)),
                      host("mid", (2, A100, 40))])
    assert where(index, spec(1)) == "small"
    assert where(index, spec(1, vram=30)) == "mid"
    assert where(index, spec(2, vram=41)) == "big"
    assert where(index, spec(1, vram=81)) is None


def test_vram_floor_applies_within_a_type() -> None:
    index = FreeGpus([host("a40", (4, A100, 40)), host("a80", (4, A100, 80))])
    assert where(index, spec(1, A100)) == "a40"  # smaller VRAM first within the type
    assert where(index, spec(1, A100, vram=41)) == "a80"
    assert where(index, spec(1, A100, vram=80)) == "a80"
    assert where(index, spec(1, H100, vram=40)) is None


def test_a_job_never_spans_types_on_a_mixed_host() -> None:
    index = FreeGpus([host("mix", (1, L4, 24), (2, A100, 80), (1, H100, 80))])
    assert index.place(spec(4)) is None
    assert index.place(spec(3)) is None
    placement = index.place(spec(2))
    assert placement == Placement("mix", (Gpu(1, A100, 80), Gpu(2, A100, 80)))
    assert placement.gpu_type == A100 and placement.indices == (1, 2)
    assert index.place(spec(1, H100)) == Placement("mix", (Gpu(3, H100, 80),))


# --- best fit ------------------------------------------------------------------------


def test_best_fit_takes_the_host_with_fewest_free_that_still_fit() -> None:
    index = FreeGpus([host("four", (4, A100, 80)), host("two", (4, A100, 80)),
                      host("one", (4, A100, 80))])
    fill(index, "two", "x", 2)
    fill(index, "one", "y", 3)
    assert where(index, spec(1)) == "one"
    assert where(index, spec(2)) == "two"
    assert where(index, spec(3)) == "four"
    assert where(index, spec(4)) == "four"
    assert where(index, spec(5)) is None


def test_ties_go_to_the_smaller_host_id() -> None:
    index = FreeGpus([host("c", (2, A100, 80)), host("b", (2, A100, 80)),
                      host("a", (4, A100, 80))])
    assert where(index, spec(1)) == "b"
    fill(index, "a", "x", 2)  # now a, b and c all have 2 free
    assert where(index, spec(2)) == "a"


def test_place_does_not_commit() -> None:
    index = FreeGpus([host("a", (2, A100, 80))])
    assert index.place(spec(2)) == index.place(spec(2))
    assert index.free_count() == 2
    assert index.hosts["a"].committed_gpus == 0


# --- commit and release ---------------------------------------------------------------


def test_commit_and_release_reindex() -> None:
    index = FreeGpus([host("a", (4, A100, 80)), host("b", (2, A100, 80))])
    assert index.free_count() == 6
    first = index.place(spec(2))
    assert first == Placement("b", (Gpu(0, A100, 80), Gpu(1, A100, 80)))
    index.commit("j1", first)
    assert index.free_count() == 4
    assert index.hosts["b"].bound("j1") == (0, 1)
    assert where(index, spec(2)) == "a"
    second = index.place(spec(3))
    assert second is not None and second.indices == (0, 1, 2)
    index.commit("j2", second)
    assert index.free_count() == 1
    assert where(index, spec(1)) == "a"
    assert index.place(spec(2)) is None
    index.release("b", "j1")
    assert index.free_count() == 3
    assert where(index, spec(2)) == "b"
    assert where(index, spec(1)) == "a"  # 1 free on a beats 2 free on b
    index.release("a", "j2")
    assert index.free_count() == 6
    assert where(index, spec(4)) == "a"


def test_release_is_idempotent_and_ignores_unknown_hosts() -> None:
    index = FreeGpus([host("a", (2, A100, 80))])
    fill(index, "a", "j", 1)
    index.release("a", "j")
    index.release("a", "j")
    index.release("a", "nobody")
    index.release("ghost", "j")
    assert index.free_count() == 2
    assert where(index, spec(2)) == "a"


def test_a_gpu_is_never_bound_twice() -> None:
    index = FreeGpus([host("a", (2, A100, 80))])
    placement = index.place(spec(1))
    assert placement is not None
    index.commit("j1", placement)
    with pytest.raises(Conflict):
        index.commit("j2", placement)
    assert index.free_count() == 1
    assert index.place(spec(1)) == Placement("a", (Gpu(1, A100, 80),))


def test_hosts_already_busy_are_indexed_as_they_are() -> None:
    busy = host("a", (4, A100, 80))
    busy.commit("old", [0, 2])
    index = FreeGpus([busy, host("b", (4, A100, 80))])
    assert index.free_count() == 6
    assert index.place(spec(2)) == Placement("a", (Gpu(1, A100, 80), Gpu(3, A100, 80)))


def test_a_host_is_indexed_once() -> None:
    index = FreeGpus([host("a", (1, A100, 80))])
    with pytest.raises(ValueError, match="twice"):
        index.add_host(host("a", (1, A100, 80)))


def test_free_count_of_an_empty_fleet() -> None:
    index = FreeGpus([])
    assert index.free_count() == 0
    assert index.place(spec(1)) is None
    assert FreeGpus([host("cpu")]).free_count() == 0


def test_zero_gpus_is_rejected() -> None:
    index = FreeGpus([host("a", (1, A100, 80))])
    with pytest.raises(ValueError, match="at least one GPU"):
        index.place(ResourceSpec(gpus=0))


# --- avoided hosts ----------------------------------------------------------------


def test_avoided_host_is_skipped_while_another_can_run_the_job() -> None:
    index = FreeGpus([host("a", (2, A100, 80)), host("b", (4, A100, 80))])
    assert where(index, spec(2)) == "a"
    assert where(index, spec(2), avoid={"a"}) == "b"
    assert where(index, spec(2), avoid=["a", "ghost"]) == "b"


def test_avoided_host_is_skipped_even_when_the_other_is_busy_now() -> None:
    index = FreeGpus([host("a", (2, A100, 80)), host("b", (2, A100, 80))])
    fill(index, "b", "x", 2)
    assert where(index, spec(1), avoid={"a"}) is None
    index.release("b", "x")
    assert where(index, spec(1), avoid={"a"}) == "b"


def test_avoid_is_ignored_when_only_avoided_hosts_could_ever_fit() -> None:
    index = FreeGpus([host("wide", (4, A100, 80)), host("narrow", (2, A100, 80)),
                      host("l4", (8, L4, 24))])
    # Only "wide" has 4 A100s; avoiding it would starve the job.
    assert where(index, spec(4, A100), avoid={"wide"}) == "wide"
    # "narrow" can never hold 3, so it does not count as an alternative.
    assert where(index, spec(3, A100), avoid={"wide"}) == "wide"
    # With all capable hosts avoided, best fit picks among them as usual.
    assert where(index, spec(2, A100), avoid={"wide", "narrow"}) == "narrow"
    # Another type that could run the job counts as an alternative.
    assert where(index, spec(4), avoid={"wide"}) == "l4"


def test_capable_hosts_ignore_current_load() -> None:
    index = FreeGpus([host("a", (2, A100, 80)), host("b", (4, A100, 40)), host("c", (1, H100, 80))])
    fill(index, "a", "x", 2)
    assert index.capable_hosts(spec(2)) == {"a", "b"}
    assert index.capable_hosts(spec(2, vram=80)) == {"a"}
    assert index.capable_hosts(spec(1, H100)) == {"c"}
    assert index.capable_hosts(spec(5)) == set()


# --- the index agrees with a brute-force scan -------------------------------------------

TYPES = [(A100, 40), (A100, 80), (H100, 80), (L4, 24)]


def free_of(h: Host, key: tuple[str, int]) -> list[Gpu]:
    return [g for g in h.free_gpus() if (g.gpu_type, g.vram_gb) == key]


def reference(hosts: Sequence[Host], s: ResourceSpec, avoid: Collection[str]) -> Placement | None:
    """The documented rule, by scanning every host."""
    keys = {(g.gpu_type, g.vram_gb) for h in hosts for g in h.gpus if g.satisfies(s)}
    if s.gpu_types:
        ordered = sorted(keys, key=lambda k: (s.gpu_types.index(k[0]), k[1]))
    else:
        ordered = sorted(keys, key=lambda k: (k[1], k[0]))
    capable = {h.id for h in hosts for k in keys
               if sum((g.gpu_type, g.vram_gb) == k for g in h.gpus) >= s.gpus}
    strict = bool(capable - set(avoid))
    for key in ordered:
        fits = [(len(free_of(h, key)), h.id, h) for h in hosts
                if len(free_of(h, key)) >= s.gpus and not (strict and h.id in avoid)]
        if fits:
            _, host_id, best = min(fits, key=lambda f: (f[0], f[1]))
            return Placement(host_id, tuple(free_of(best, key)[: s.gpus]))
    return None


host_layouts = st.lists(
    st.lists(st.tuples(st.integers(1, 4), st.sampled_from(TYPES)), min_size=0, max_size=2),
    min_size=1, max_size=6)
specs = st.builds(
    lambda n, types, vram: ResourceSpec(gpus=n, vram_gb=vram, gpu_types=tuple(types)),
    st.integers(1, 5),
    st.lists(st.sampled_from([A100, H100, L4]), max_size=3, unique=True),
    st.sampled_from([0, 0, 30, 48, 80]))


class PlacementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.hosts: list[Host] = []
        self.index = FreeGpus([])
        self.holders: dict[str, str] = {}  # holder -> host id
        self.serial = 0

    @initialize(layouts=host_layouts)
    def build(self, layouts: list[list[tuple[int, tuple[str, int]]]]) -> None:
        self.hosts = [host(f"h{i:02d}", *[(n, t, v) for n, (t, v) in groups])
                      for i, groups in enumerate(layouts)]
        self.index = FreeGpus(self.hosts)

    @rule(s=specs, avoid=st.sets(st.sampled_from([f"h{i:02d}" for i in range(6)]), max_size=3),
          commit=st.booleans())
    def place(self, s: ResourceSpec, avoid: set[str], commit: bool) -> None:
        got = self.index.place(s, avoid)
        assert got == reference(self.hosts, s, avoid)
        if got is None:
            return
        h = self.index.hosts[got.host_id]
        assert len(got.gpus) == s.gpus
        assert all(g.satisfies(s) and h.holder_of(g.index) is None for g in got.gpus)
        assert len({(g.gpu_type, g.vram_gb) for g in got.gpus}) == 1
        if commit:
            self.serial += 1
            holder = f"j{self.serial}"
            self.index.commit(holder, got)
            self.holders[holder] = got.host_id

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.holders:
            return
        holder = data.draw(st.sampled_from(sorted(self.holders)))
        self.index.release(self.holders.pop(holder), holder)

    @invariant()
    def counts_agree(self) -> None:
        assert self.index.free_count() == sum(len(h.free_gpus()) for h in self.hosts)
        for h in self.hosts:
            assert h.committed_gpus == sum(len(h.bound(j)) for j, hid in self.holders.items()
                                           if hid == h.id)


PlacementMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25,
                                              deadline=None)
TestPlacementIndex = PlacementMachine.TestCase
