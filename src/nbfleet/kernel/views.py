"""NumPy views pickled as views of their base, so memory sharing survives a restore.

NumPy pickles a view as a copy of the elements it shows: after a restore,
``b = a[::2]`` no longer writes through to ``a``. Here a view is pickled as
``(its root array, byte offset, shape, strides, dtype)``; the root goes into the
same pickle (one memo), so every view of it in the group is rebuilt on the one
restored buffer. Only exact ``ndarray`` views of a contiguous exact-``ndarray``
root qualify (a root NumPy would re-lay-out on pickling would move the views'
offsets); anything else is pickled as NumPy does.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def _numpy() -> Any:
    return sys.modules.get("numpy")  # never import it: a kernel without NumPy has no views


def _root(array: Any, ndarray: type) -> Any:
    root: Any = array
    while isinstance(root.base, ndarray):
        root = root.base
    return root


def _usable_root(root: Any, ndarray: Any) -> bool:
    """An exact ndarray of plain data that NumPy pickles with the same layout."""
    return (root.__class__ is ndarray and not root.dtype.hasobject
            and bool(root.flags.c_contiguous or root.flags.f_contiguous))


def _address(array: Any) -> int:
    return int(array.__array_interface__["data"][0])


def reduce_view(obj: object) -> tuple[Any, ...] | None:
    """A reduce tuple rebuilding ``obj`` on its root array, or None to pickle it as usual."""
    np = _numpy()
    if np is None or type(obj) is not np.ndarray:
        return None
    array: Any = obj
    base = array.base
    if base is None or not isinstance(base, np.ndarray) or array.size == 0:
        return None
    root: Any = _root(array, np.ndarray)
    if root is array or not _usable_root(root, np.ndarray):
        return None
    offset = _address(array) - _address(root)
    if offset < 0 or offset >= root.nbytes:
        return None  # not inside its root (cannot happen for a real view; be safe)
    return (rebuild_view, (root, offset, array.shape, array.strides, array.dtype,
                           bool(array.flags.writeable)))


def rebuild_view(root: Any, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dtype: Any, writeable: bool) -> Any:
    """The view again, on ``root``'s memory (its ``base`` is ``root``)."""
    np: Any = sys.modules.get("numpy") or importlib.import_module("numpy")
    view = np.ndarray(shape, dtype=dtype, buffer=root, offset=offset, strides=strides)
    if not writeable and view.flags.writeable:
        view.flags.writeable = False
    return view
