"""Sortable, kind-prefixed identifiers (``ws_01J...``).

The layout follows ULID: 48 bits of milliseconds then 80 random bits, in Crockford
base32, so ids sort by creation time and index well. The caller supplies both the
time and the entropy, which keeps this module pure.
"""

from __future__ import annotations

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
_ENTROPY_BYTES = 10


def encode_id(kind: str, millis: int, entropy: bytes) -> str:
    """Build ``<kind>_<26 base32 chars>`` from a timestamp and 10 random bytes."""
    if len(entropy) != _ENTROPY_BYTES:
        raise ValueError(f"entropy must be {_ENTROPY_BYTES} bytes")
    if not 0 <= millis < 1 << 48:
        raise ValueError("millis out of range")
    value = (millis << 80) | int.from_bytes(entropy, "big")
    chars = []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return f"{kind}_{''.join(reversed(chars))}"


def id_kind(identifier: str) -> str:
    """The kind prefix of an id, or '' when it has none."""
    kind, sep, _ = identifier.partition("_")
    return kind if sep else ""
