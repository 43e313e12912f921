"""The pickler behind every snapshot: cloudpickle, with three changes.

Functions defined in cells are pickled without their globals (restored, they
look names up in the new kernel's namespace, as the originals did); NumPy views
are pickled as views of their base (:mod:`nbfleet.kernel.views`); and objects
that stand for OS resources are refused, so recipes recreate them for real.
Library objects that change when pickled are fixed (:mod:`nbfleet.kernel.quirks`).
dill is the fallback for what cloudpickle cannot do.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import io
import pickle
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cloudpickle

from nbfleet.kernel import quirks, views

_REASON_LIMIT = 300


class Unpicklable(Exception):
    """Neither cloudpickle nor dill could serialize the value; the message says why."""


def type_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _resource_types() -> tuple[type, ...]:
    """Objects that stand for OS resources: pickling them would fake the resource
    (cloudpickle snapshots a file's text, dill re-creates locks), so they are
    refused and left to recipes, which recreate them for real."""
    import _thread
    import socket

    return (
        io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom,
        io.BufferedRWPair, io.TextIOWrapper, _thread.LockType, _thread.RLock, socket.socket,
    )


_RESOURCES = _resource_types()


def _refuse_resource(obj: object) -> None:
    if isinstance(obj, _RESOURCES):
        raise pickle.PicklingError(f"{type_name(obj)} holds an OS resource")


# -- functions defined in cells ------------------------------------------------------

_target_namespace: dict[str, Any] | None = None


@contextlib.contextmanager
def loading_into(namespace: dict[str, Any]) -> Iterator[None]:
    """Functions unpickled inside this block get ``namespace`` as their globals."""
    global _target_namespace
    previous, _target_namespace = _target_namespace, namespace
    try:
        yield
    finally:
        _target_namespace = previous


class _EmptyCell:
    """Marks a closure cell that had no value (pickled by reference)."""


def _make_function(code: types.CodeType, name: str, ncells: int) -> types.FunctionType:
    namespace = _target_namespace
    if namespace is None:
        namespace = {"__builtins__": builtins, "__name__": "__main__"}
    closure = tuple(types.CellType() for _ in range(ncells)) if ncells else None
    return types.FunctionType(code, namespace, name, None, closure)


def _set_function_state(func: types.FunctionType, state: dict[str, Any]) -> types.FunctionType:
    cells = state.pop("__closure__")
    for cell, value in zip(func.__closure__ or (), cells, strict=True):
        if value is not _EmptyCell:
            cell.cell_contents = value
    attributes = state.pop("__dict__")
    for key, value in state.items():
        setattr(func, key, value)
    func.__dict__.update(attributes)
    return func


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:
        return _EmptyCell


class CapturePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, except that functions living in the user namespace are pickled
    *without* their globals: restored, they look names up in the new kernel's
    namespace like the originals did (cloudpickle would freeze a private copy of
    every global they use, a big array included)."""

    def __init__(self, file: io.BytesIO, user_ns: Mapping[str, Any],
                 buffer_callback: Callable[[pickle.PickleBuffer], None] | None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._user_ns = user_ns

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self._user_ns:
            state = {
                "__defaults__": obj.__defaults__,
                "__kwdefaults__": obj.__kwdefaults__,
                "__qualname__": obj.__qualname__,
                "__module__": obj.__module__,
                "__doc__": obj.__doc__,
                "__annotations__": obj.__annotations__,
                "__dict__": dict(obj.__dict__),
                "__closure__": [_cell_value(c) for c in obj.__closure__ or ()],
            }
            ncells = len(obj.__closure__ or ())
            # State goes after construction so self-references (recursion,
            # methods calling super()) do not recurse forever.
            return (_make_function, (obj.__code__, obj.__name__, ncells), state,
                    None, None, _set_function_state)
        fixed = views.reduce_view(obj) or quirks.reduce(obj)
        if fixed is not None:
            return fixed
        _refuse_resource(obj)
        return super().reducer_override(obj)


@functools.cache
def _strict_dill() -> type:
    import dill  # imported on first use: most kernels never need it

    class StrictDill(dill.Pickler):  # type: ignore[misc]
        def reducer_override(self, value: object) -> Any:
            _refuse_resource(value)
            return NotImplemented

    return StrictDill


def dill_pickler(out: io.BytesIO) -> Any:
    """dill as fallback, in band, refusing OS resources like the main pickler."""
    return _strict_dill()(out, protocol=5)


def reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _REASON_LIMIT else text[: _REASON_LIMIT - 3] + "..."
