"""Hosts, subscriptions and GPU bindings; GPU choice on heterogeneous hosts."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from nbfleet.model.cluster import Gpu, Host, ResourceSpec
from nbfleet.model.errors import Conflict, InvalidInput
from nbfleet.model.resources import HostInventory, parse_gpu_spec
from nbfleet.policy.gpu_fit import choose_gpus


def host(spec: str = "8xA100-80GB", host_id: str = "h1") -> Host:
    return Host.from_inventory(host_id, HostInventory(64_000, 512_000, parse_gpu_spec(spec)))


def test_subscription_ratio_matches_the_papers_example() -> None:
    # NotebookOS section 3.4: 8 GPUs, four kernels of 4 GPUs each, 3 replicas -> 16/24.
    h = host()
    for k in range(4):
        h.subscribe(f"kernel{k}-r0", ResourceSpec(gpus=4))
    assert h.subscribed_gpus == 16
    assert h.subscription_ratio(replicas=3) == pytest.approx(16 / 24)
    assert h.committed_gpus == 0  # subscribing binds nothing


def test_oversubscription_is_allowed_but_binding_is_exclusive() -> None:
    h = host("2xA100-80GB")
    h.subscribe("a", ResourceSpec(gpus=2))
    h.subscribe("b", ResourceSpec(gpus=2))
    assert h.subscription_ratio(1) == 2.0
    assert h.commit("a", [0, 1]) == (0, 1)
    assert choose_gpus(h.free_gpus(), ResourceSpec(gpus=1)) is None
    with pytest.raises(Conflict, match="bound to a"):
        h.commit("b", [1])
    assert h.release("a") == (0, 1)
    assert h.release("a") == ()  # idempotent
    assert h.commit("b", [0, 1]) == (0, 1)
    h.unsubscribe("b")
    assert h.committed_gpus == 0 and h.subscribed_gpus == 2


def test_bad_commits_change_nothing() -> None:
    h = host("2xA100-80GB")
    with pytest.raises(InvalidInput, match="no GPU 7"):
        h.commit("a", [0, 7])
    assert h.committed_gpus == 0  # all or nothing
    h.commit("a", [0])
    with pytest.raises(Conflict, match="already holds"):
        h.commit("a", [1])


def test_preferences_pick_the_first_type_that_fits() -> None:
    mixed = host("2xA100-40GB,4xH100-80GB,1xL4-24GB")
    free = mixed.free_gpus()
    h100 = choose_gpus(free, ResourceSpec(gpus=2, gpu_types=("H100-80GB", "A100-40GB")))
    assert h100 is not None and {g.gpu_type for g in h100} == {"H100-80GB"}
    # A100 preferred but only 2 exist: the request for 3 falls through to H100.
    fallback = choose_gpus(free, ResourceSpec(gpus=3, gpu_types=("A100-40GB", "H100-80GB")))
    assert fallback is not None and {g.gpu_type for g in fallback} == {"H100-80GB"}
    # A VRAM floor excludes the small cards whatever the preference.
    assert choose_gpus(free, ResourceSpec(gpus=1, vram_gb=48, gpu_types=("L4-24GB",))) is None
    # No preference: the smallest card that fits, keeping big ones free.
    smallest = choose_gpus(free, ResourceSpec(gpus=1, vram_gb=30))
    assert smallest is not None and smallest[0].gpu_type == "A100-40GB"
    # One binding never mixes types.
    assert choose_gpus(free, ResourceSpec(gpus=5)) is None
    assert choose_gpus(free, ResourceSpec()) == ()


def test_resource_spec_validation() -> None:
    with pytest.raises(InvalidInput, match="negative"):
        ResourceSpec(gpus=-1)
    with pytest.raises(InvalidInput, match="at least one GPU"):
        ResourceSpec(vram_gb=40)
    with pytest.raises(InvalidInput, match="twice"):
        Host("h", 1000, 1024, [Gpu(0, "A", 1), Gpu(0, "A", 1)])


@st.composite
def specs(draw: st.DrawFn) -> ResourceSpec:
    gpus = draw(st.integers(0, 4))
    if gpus == 0:
        return ResourceSpec()
    return ResourceSpec(
        gpus=gpus,
        vram_gb=draw(st.sampled_from([0, 24, 40, 80])),
        gpu_types=draw(st.sampled_from([(), ("A100-80GB",), ("L4-24GB", "A100-80GB")])),
    )


SPECS = specs()


class HostMachine(RuleBasedStateMachine):
    """Random subscribe/commit/release/unsubscribe sequences keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.host = host("4xA100-80GB,2xL4-24GB")
        self.specs: dict[str, ResourceSpec] = {}
        self.holding: dict[str, tuple[int, ...]] = {}

    @rule(holder=st.sampled_from("abcdef"), spec=SPECS)
    def subscribe(self, holder: str, spec: ResourceSpec) -> None:
        if holder in self.specs:
            return
        self.host.subscribe(holder, spec)
        self.specs[holder] = spec

    @rule(holder=st.sampled_from("abcdef"))
    def execute(self, holder: str) -> None:
        spec = self.specs.get(holder)
        if spec is None or holder in self.holding:
            return
        chosen = choose_gpus(self.host.free_gpus(), spec)
        if chosen is None:
            return
        assert all(g.satisfies(spec) for g in chosen) and len(chosen) == spec.gpus
        assert len({g.gpu_type for g in chosen}) <= 1
        self.holding[holder] = self.host.commit(holder, [g.index for g in chosen])

    @rule(holder=st.sampled_from("abcdef"), wanted=st.sets(st.integers(0, 5), max_size=3))
    def grab(self, holder: str, wanted: set[int]) -> None:
        """Bind arbitrary GPUs, taken or not: refused whole if any is taken."""
        if holder in self.holding:
            return
        taken = {i for held in self.holding.values() for i in held}
        if wanted & taken:
            before = self.host.committed_gpus
            try:
                self.host.commit(holder, wanted)
            except Conflict:
                assert self.host.committed_gpus == before
                return
            raise AssertionError("a bound GPU was committed twice")
        self.holding[holder] = self.host.commit(holder, wanted)

    @rule(holder=st.sampled_from("abcdef"))
    def finish(self, holder: str) -> None:
        assert self.host.release(holder) == self.holding.pop(holder, ())

    @rule(holder=st.sampled_from("abcdef"))
    def leave(self, holder: str) -> None:
        self.host.unsubscribe(holder)
        self.specs.pop(holder, None)
        self.holding.pop(holder, None)

    @invariant()
    def no_gpu_is_double_committed(self) -> None:
        indices = [i for held in self.holding.values() for i in held]
        assert len(indices) == len(set(indices))
        for holder, held in self.holding.items():
            assert all(self.host.holder_of(i) == holder for i in held)

    @invariant()
    def committed_never_exceeds_capacity(self) -> None:
        assert self.host.committed_gpus == sum(len(h) for h in self.holding.values())
        assert self.host.committed_gpus <= len(self.host.gpus)
        assert len(self.host.free_gpus()) == len(self.host.gpus) - self.host.committed_gpus

    @invariant()
    def subscriptions_are_tracked(self) -> None:
        assert self.host.subscribed_gpus == sum(s.gpus for s in self.specs.values())


TestHostMachine = HostMachine.TestCase
