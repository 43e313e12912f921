"""Pickling a group of names into one manifest entry, and back.

The values of a group are dumped one after the other by one pickler, so they
share its memo: an object reachable from two names is pickled once and comes
back as one object. Values are pickled with protocol 5 so large numpy/pandas
buffers come out of band without a copy; each buffer is stored content-addressed
(see :mod:`nbfleet.kernel.blobs`), so an unchanged array costs a hash, never a
write. Each value's slice of the stream, with tokens of its buffers, gives its
digest: what a restore compares to say "restored" truthfully.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import pickle
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbfleet.kernel import tokens
from nbfleet.kernel.blobs import BlobStore, Ref
from nbfleet.kernel.graph import IdentityFilter

# Pickles written before the pickler moved out of this module name these.
from nbfleet.kernel.pickler import (  # noqa: F401
    CapturePickler,
    Unpicklable,
    _EmptyCell,
    _make_function,
    _set_function_state,
    dill_pickler,
    loading_into,
    reason,
    type_name,
)

__all__ = ["Encoded", "Entry", "Unpicklable", "decode", "decode_group", "encode", "encode_group",
           "loading_into", "type_name"]

Entry = dict[str, Any]
"""One pickle in the manifest: pickler, stream, buffers, size."""

_MEMOIZE = pickle.MEMOIZE  # one per memoized object (or a byte of data that looks like it)


@dataclass(frozen=True)
class Encoded:
    """One group, pickled."""

    entry: Entry
    digests: tuple[str, ...]
    """Per value: sha256 of its stream slice and its buffers' tokens."""
    reached: list[object] | None
    """The identity-bearing objects the pickle reached (see :mod:`nbfleet.kernel.graph`);
    None if not looked at (not asked, or more objects than asked to look at)."""
    seconds: float


def _raw(buffer: pickle.PickleBuffer) -> memoryview:
    try:
        return buffer.raw()
    except BufferError:  # not contiguous: pay for a copy
        return memoryview(bytes(memoryview(buffer)))


def _is_module(obj: object) -> bool:
    return isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj


class _Parts:
    """Stores (or, without a store, only names) the buffers of one pickle."""

    def __init__(self, store: BlobStore | None, cache: tokens.ShaCache | None) -> None:
        self.store = store
        self.cache = cache
        self.refs: list[Ref] = []
        self.tokens: list[str] = []
        self.bytes = 0

    def add(self, data: memoryview) -> None:
        self.bytes += data.nbytes
        big = data.nbytes > tokens.FULL_LIMIT
        token = tokens.verify_token(data) if big or self.store is None else None
        if self.store is None:
            self.tokens.append(token or "")
            return
        sha: str | None = None
        key: tuple[int, int, str] | None = None
        if big and self.cache is not None and token is not None:
            place = tokens.address(data)
            if place is not None:
                key = (place, data.nbytes, token)
                sha = self.cache.get(key)
        known = sha is not None and self.store.has(sha)
        ref: Ref = {"blob": sha} if known and sha is not None else self.store.put(data)
        if key is not None and self.cache is not None and "blob" in ref:
            self.cache.put(key, ref["blob"])
        self.refs.append(ref)
        self.tokens.append(token or tokens.verify_token(data, ref.get("blob")))


def _digest(segment: memoryview, buffer_tokens: Sequence[str]) -> str:
    digest = hashlib.sha256(segment)
    for token in buffer_tokens:
        digest.update(b"|" + token.encode())
    return digest.hexdigest()


def encode_group(values: Sequence[object], user_ns: Mapping[str, Any], store: BlobStore | None,
                 cache: tokens.ShaCache | None = None, *, use_dill: bool = False,
                 track: int | None = None) -> Encoded:
    """Pickle ``values`` with one memo; raises :class:`Unpicklable`.

    Without a store nothing is written: only the digests are wanted (a restore
    checking what it loaded; ``use_dill`` to check a dill pickle). ``cache``: reuse
    the sha256 of big buffers that look unchanged (background checks only).
    ``track``: collect what the pickle reached (grouping needs it) if it memoized at
    most that many objects (copying a pickler's memo costs about 0.5 us an object);
    0 for no limit.
    """
    started = time.perf_counter()
    if len(values) == 1 and _is_module(values[0]):
        name = memoryview(getattr(values[0], "__name__", "").encode())
        module: Entry = {"pickler": "module", "stream": store.put(name) if store else {},
                         "buffers": [], "size": name.nbytes}
        return Encoded(module, (tokens.sha256(name),), [], time.perf_counter() - started)
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    bounds: list[tuple[int, int]] = []
    try:
        if use_dill:
            raise pickle.PicklingError("checking a dill pickle")
        pickler = CapturePickler(out, user_ns, buffers.append)
        for value in values:
            pickler.dump(value)
            bounds.append((out.tell(), len(buffers)))
        kind = "cloudpickle"
    except Exception as error:
        buffers.clear()
        bounds.clear()
        out = io.BytesIO()
        try:
            pickler = dill_pickler(out)
            for value in values:
                pickler.dump(value)
                bounds.append((out.tell(), 0))
            kind = "dill"
        except Exception:
            raise Unpicklable(reason(error)) from None
    reached: list[object] | None = None
    if track is not None and (not track or out.getbuffer().tobytes().count(_MEMOIZE) <= track):
        reached = IdentityFilter(user_ns).objects(pickler.memo.copy())
    del pickler
    stream = out.getbuffer()
    parts = _Parts(store, cache)
    for buffer in buffers:
        parts.add(_raw(buffer))
    digests = []
    start, first = 0, 0
    for end, last in bounds:
        digests.append(_digest(stream[start:end], parts.tokens[first:last]))
        start, first = end, last
    entry: Entry = {"pickler": kind, "buffers": parts.refs, "size": stream.nbytes + parts.bytes}
    if store is not None:
        entry["stream"] = store.put(stream)
    del stream
    return Encoded(entry, tuple(digests), reached, time.perf_counter() - started)


def encode(obj: object, user_ns: Mapping[str, Any], store: BlobStore) -> Entry:
    """One value on its own (settings); raises :class:`Unpicklable`."""
    entry = encode_group([obj], user_ns, store).entry
    return {"type": type_name(obj), **entry}


_NUMPY_FROMBUFFER = frozenset({("numpy._core.numeric", "_frombuffer"),
                               ("numpy.core.numeric", "_frombuffer")})


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: str, axis_order: Any = None) -> Any:
    """NumPy's own, minus the intermediate array: the restored array's ``base`` is the
    buffer, as an array that owns its memory has none, so it pickles (and is a view's
    root) the way the original did. Its digest then matches."""
    np: Any = sys.modules["numpy"]
    if order == "K" and axis_order is not None:
        return np.frombuffer(buf, dtype=dtype).reshape(shape, order="C").transpose(axis_order)
    return np.ndarray(shape, dtype=dtype, buffer=buf, order=order)


class _Loader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_FROMBUFFER:
            importlib.import_module("numpy")
            return _frombuffer
        return super().find_class(module, name)


def decode_group(entry: Entry, fetch: Callable[[Ref], bytearray], count: int) -> list[object]:
    """Rebuild a group's ``count`` values; ``fetch`` returns a private, writable copy
    of each part."""
    stream = fetch(entry["stream"])
    if entry["pickler"] == "module":
        return [importlib.import_module(stream.decode())]
    if entry["pickler"] == "dill":
        import dill

        loader: Any = dill.Unpickler(io.BytesIO(bytes(stream)))
    else:
        buffers = [fetch(ref) for ref in entry["buffers"]]
        loader = _Loader(io.BytesIO(stream), buffers=buffers)
    return [loader.load() for _ in range(count)]


def decode(entry: Entry, fetch: Callable[[Ref], bytearray]) -> object:
    return decode_group(entry, fetch, 1)[0]
