"""Pickling one value into a manifest entry, and back.

Values are pickled with protocol 5 so large numpy/pandas buffers come out of
band without a copy; each buffer is then stored content-addressed (see
:mod:`nbfleet.kernel.blobs`), so an unchanged array costs a hash, never a write.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cloudpickle

from nbfleet.kernel.blobs import BlobStore, Ref

Entry = dict[str, Any]
"""One value in manifest["values"]: type, pickler, stream, buffers, size."""

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


class _CapturePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, except that functions living in the user namespace are pickled
    *without* their globals: restored, they look names up in the new kernel's
    namespace like the originals did (cloudpickle would freeze a private copy of
    every global they use, a big array included)."""

    def __init__(self, file: io.BytesIO, user_ns: Mapping[str, Any],
                 buffer_callback: Callable[[pickle.PickleBuffer], None]) -> None:
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


def _dill_dumps(obj: object) -> bytes:
    """dill as fallback, in band, refusing OS resources like the main pickler."""
    out = io.BytesIO()
    _strict_dill()(out, protocol=5).dump(obj)
    return out.getvalue()


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _REASON_LIMIT else text[: _REASON_LIMIT - 3] + "..."


def _raw(buffer: pickle.PickleBuffer) -> memoryview:
    try:
        return buffer.raw()
    except BufferError:  # not contiguous: pay for a copy
        return memoryview(bytes(memoryview(buffer)))


def encode(obj: object, user_ns: Mapping[str, Any], store: BlobStore) -> Entry:
    """Serialize ``obj`` and store its parts; raises :class:`Unpicklable`."""
    kind = type_name(obj)
    if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
        name = obj.__name__.encode()
        return {"type": kind, "pickler": "module", "stream": store.put(memoryview(name)),
                "buffers": [], "size": len(name)}
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    try:
        _CapturePickler(out, user_ns, buffers.append).dump(obj)
        pickler, stream = "cloudpickle", out.getbuffer()
    except Exception as error:
        buffers.clear()
        try:
            pickler, stream = "dill", memoryview(_dill_dumps(obj))
        except Exception:
            raise Unpicklable(_reason(error)) from None
    views = [_raw(b) for b in buffers]
    return {
        "type": kind,
        "pickler": pickler,
        "stream": store.put(stream),
        "buffers": [store.put(view) for view in views],
        "size": stream.nbytes + sum(view.nbytes for view in views),
    }


def decode(entry: Entry, fetch: Callable[[Ref], bytearray]) -> object:
    """Rebuild a value; ``fetch`` returns a private, writable copy of each part."""
    stream = fetch(entry["stream"])
    if entry["pickler"] == "module":
        return importlib.import_module(stream.decode())
    if entry["pickler"] == "dill":
        import dill

        return dill.loads(bytes(stream))
    buffers = [fetch(ref) for ref in entry["buffers"]]
    return pickle.loads(stream, buffers=buffers)
