"""Whether a restored value is the value that was saved, before saying "restored".

The restored group is pickled again, without writing anything, and each name's
digest compared with the one the snapshot recorded (the digest of the value as it
was at suspend: a flush re-checks every group exactly). Equal digests mean equal
pickles, so the value is the one that was saved. A mismatch may still be benign
(a set that iterates in another order in this process), so the value's structural
digest (:mod:`nbfleet.kernel.shape`) decides when the snapshot has one; otherwise
the name is reported as changed, with the reason. Names pickled in one group share
a memo, so a difference puts every name pickled from it on to the shape test. Big
buffers count by their size and a sample (:mod:`nbfleet.kernel.tokens`); their
bytes came from blobs named by their sha256.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nbfleet.kernel import codec, shape

DIFFERS = "it came back different from the value saved at suspend"


def check(names: Sequence[str], values: Sequence[object], infos: Sequence[Mapping[str, Any]],
          pickler: str, user_ns: Mapping[str, Any]) -> dict[str, str]:
    """Why each name that is not verified equal is not; verified names are absent.

    ``infos``: each name's manifest entry (its ``digest`` and ``shape``). A snapshot
    written before digests existed has none to compare: its names pass as before.
    """
    expected = [info.get("digest") for info in infos]
    if all(digest is None for digest in expected):
        return {}
    try:
        encoded = codec.encode_group(values, user_ns, None, use_dill=pickler == "dill")
    except codec.Unpicklable as error:
        return {name: f"{DIFFERS}: it cannot be pickled again ({error})" for name in names}
    differing = [name for name, digest, now in zip(names, expected, encoded.digests, strict=True)
                 if digest is not None and digest != now]
    if not differing:
        return {}
    # One memo: a slice refers back to objects pickled in earlier slices, never to
    # later ones. Names before the first difference are equal; from it on, the
    # shapes decide.
    first = names.index(differing[0])
    reasons: dict[str, str] = {}
    for name, value, info in list(zip(names, values, infos, strict=True))[first:]:
        saved_shape = info.get("shape")
        if saved_shape and shape.shape(value, user_ns) == saved_shape:
            continue
        if name in differing or info.get("digest") is None:
            reasons[name] = f"{DIFFERS} (its digest differs); it is loaded as it came back"
        else:
            reasons[name] = (f"{DIFFERS}: it shares objects with {differing[0]}, which "
                             "differs; it is loaded as it came back")
    return reasons
