"""Sortable, kind-prefixed identifiers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbfleet.model.ids import encode_id, id_kind

CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
MAX_MILLIS = (1 << 48) - 1

millis_st = st.integers(min_value=0, max_value=MAX_MILLIS)
entropy_st = st.binary(min_size=10, max_size=10)


def _decode(identifier: str) -> tuple[str, int, bytes]:
    """An independent decoder: kind, millis and entropy back out of an id."""
    kind, _, body = identifier.partition("_")
    value = 0
    for ch in body:
        value = value * 32 + CROCKFORD.index(ch)
    return kind, value >> 80, (value & ((1 << 80) - 1)).to_bytes(10, "big")


def test_shape() -> None:
    identifier = encode_id("ws", 1_700_000_000_000, bytes(range(10)))
    assert identifier.startswith("ws_")
    assert len(identifier) == len("ws_") + 26
    assert set(identifier[3:]) <= set(CROCKFORD)


def test_extremes() -> None:
    assert encode_id("ws", 0, bytes(10)) == "ws_" + "0" * 26
    # 128 bits in 26 five-bit characters: the leading character holds only 3 bits.
    assert encode_id("ws", MAX_MILLIS, b"\xff" * 10) == "ws_7" + "z" * 25


def test_matches_ulid_reference_timestamp() -> None:
    # The ULID README: ulid(1469918176385) starts with 01ARYZ6S41.
    assert encode_id("x", 1469918176385, bytes(10))[2:12] == "01aryz6s41"


@given(millis=millis_st, entropy=entropy_st)
def test_round_trips(millis: int, entropy: bytes) -> None:
    assert _decode(encode_id("job", millis, entropy)) == ("job", millis, entropy)


@given(a=millis_st, b=millis_st, ea=entropy_st, eb=entropy_st)
def test_ids_sort_by_millis(a: int, b: int, ea: bytes, eb: bytes) -> None:
    ida, idb = encode_id("ws", a, ea), encode_id("ws", b, eb)
    if a < b:
        assert ida < idb
    elif a > b:
        assert ida > idb
    else:
        assert (ida < idb) == (ea < eb)
        assert (ida == idb) == (ea == eb)


@pytest.mark.parametrize("size", [0, 9, 11, 16])
def test_rejects_wrong_entropy_length(size: int) -> None:
    with pytest.raises(ValueError, match="entropy"):
        encode_id("ws", 0, bytes(size))


@pytest.mark.parametrize("millis", [-1, 1 << 48, 1 << 60])
def test_rejects_out_of_range_millis(millis: int) -> None:
    with pytest.raises(ValueError, match="millis"):
        encode_id("ws", millis, bytes(10))


@given(kind=st.sampled_from(["ws", "job", "org", "tok"]), millis=millis_st, entropy=entropy_st)
def test_id_kind_of_encoded_id(kind: str, millis: int, entropy: bytes) -> None:
    assert id_kind(encode_id(kind, millis, entropy)) == kind


@pytest.mark.parametrize(
    ("identifier", "kind"),
    [("ws_01abc", "ws"), ("nounderscore", ""), ("_01abc", ""), ("", ""), ("a_b_c", "a")],
)
def test_id_kind(identifier: str, kind: str) -> None:
    assert id_kind(identifier) == kind
