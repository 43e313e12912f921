"""Library objects that change when pickled, made to pickle the same way twice.

A digest is only worth comparing if pickling the same value twice gives the same
bytes. matplotlib's ``CallbackRegistry.__getstate__`` draws the next id from its
counter, so every figure pickled (by a check after a cell, by a restore's
verification) would differ from the last and look changed. Here such an object
is reduced as usual, then its counter is put back where the pickle left it.

Some state is bookkeeping that a restore itself moves on: unpickling a figure
connects its new canvas, which draws ids from the same counter. A structural
digest (:mod:`nbfleet.kernel.shape`) leaves such fields out (:func:`shape_state`).
"""

from __future__ import annotations

import itertools
from typing import Any


def _callback_registry(obj: Any) -> Any:
    reduced = obj.__reduce_ex__(5)
    state = reduced[2] if len(reduced) > 2 else None
    if isinstance(state, dict) and isinstance(state.get("_cid_gen"), int):
        obj._cid_gen = itertools.count(state["_cid_gen"])  # as the unpickled copy will have it
    return reduced


_FIXES = {"matplotlib.cbook.CallbackRegistry": _callback_registry}
#: Per class (and its subclasses): fields that say what needs redrawing or which id
#: comes next, which a restored figure recomputes before it is drawn again.
_BOOKKEEPING = {
    "matplotlib.cbook.CallbackRegistry": frozenset({"_cid_gen"}),
    "matplotlib.transforms.TransformNode": frozenset({"_invalid"}),
    "matplotlib.artist.Artist": frozenset({"_stale"}),
}


def reduce(obj: object) -> Any:
    """``obj``'s reduce tuple if it needs a fix, else None (cheap for everything else)."""
    kind = type(obj)
    if not kind.__module__.startswith("matplotlib"):
        return None
    fix = _FIXES.get(f"{kind.__module__}.{kind.__qualname__}")
    return fix(obj) if fix is not None else None


def shape_state(obj: object, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the fields a restore moves on by itself."""
    if not type(obj).__module__.startswith("matplotlib"):
        return state
    skip: set[str] = set()
    for kind in type(obj).__mro__:
        skip |= _BOOKKEEPING.get(f"{kind.__module__}.{kind.__qualname__}", frozenset())
    return {k: v for k, v in state.items() if k not in skip} if skip else state
