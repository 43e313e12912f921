"""A structural digest of a value that another process can compute alike.

The pickle digests of :mod:`nbfleet.kernel.codec` are exact but not always
portable: a set of strings iterates in another order under another hash seed,
and a string interned in one process is two objects in the next, which changes
the pickle's memo. When a restored value's pickle does not match, its shape
decides: a walk that mirrors pickling (containers item by item, other objects
through ``__reduce_ex__``), with sets sorted by their elements' digests, strings
by value, objects shared inside the value numbered by first visit, and arrays by
their bytes (a sample of them past :data:`nbfleet.kernel.tokens.FULL_LIMIT`).
It runs in Python (about a microsecond an object), so it stops after :data:`LIMIT`
objects, numbers and strings included; a bigger value has no shape and is judged
by its pickle alone.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import sys
import types
from collections.abc import Mapping
from typing import Any

from nbfleet.kernel import quirks, tokens

LIMIT = 200_000
_SAMPLE_ELEMENTS = 32_768


class _TooBig(Exception):
    pass


class _Token(bytes):
    """Bytes to emit as they are (a plain ``bytes`` on the stack is a value)."""


def _atom(obj: Any) -> bytes | None:
    kind = type(obj)
    if obj is None:
        return b"n"
    if kind is bool:
        return b"t" if obj else b"f"
    if kind is int:
        return b"i" + hex(obj).encode() + b";"
    if kind is float:
        return b"d" + struct.pack("<d", obj)
    if kind is complex:
        return b"c" + struct.pack("<dd", obj.real, obj.imag)
    if kind is str:
        data: bytes = obj.encode("utf-8", "surrogatepass")
        return b"s%d:" % len(data) + data
    if kind is bytes:
        return b"b%d:" % len(obj) + bytes(obj)
    return None


def _qualified(obj: object) -> bytes:
    if isinstance(obj, types.ModuleType):
        return b"m" + obj.__name__.encode()
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"g{module}.{name};".encode()


_CONTAINERS = frozenset({list, tuple, dict, set, frozenset})
_ATOMIC = frozenset({str, int, float, bool, type(None), bytes, complex})
_FLAT_MIN = 16


def _flat(obj: Any, kind: type) -> bytes | None:
    """One token for a big container of numbers and strings (a pandas object column,
    a vocabulary): its pickle, which is deterministic for such values, hashed in C."""
    if len(obj) < _FLAT_MIN:
        return None
    if kind is dict:
        if not (set(map(type, obj)) | set(map(type, obj.values()))) <= _ATOMIC:
            return None
    elif not set(map(type, obj)) <= _ATOMIC:
        return None
    if kind is set or kind is frozenset:
        try:
            obj = sorted(obj)
        except TypeError:
            return None
    data = pickle.dumps(obj, protocol=5)
    return b"P" + kind.__name__.encode() + tokens.sha256(data).encode()


_BY_REFERENCE = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodDescriptorType,
                 types.WrapperDescriptorType, types.MethodWrapperType)


class _Walker:
    def __init__(self, user_ns: Mapping[str, Any], limit: int) -> None:
        self.user_ns = user_ns
        self.limit = limit
        self.count = 0
        self.digest = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self.keep: list[object] = []  # objects made by __reduce_ex__ must outlive their ids
        self.np: Any = sys.modules.get("numpy")

    def run(self, root: object) -> str:
        stack: list[object] = [root]
        while stack:
            item = stack.pop()
            if type(item) is _Token:
                self.digest.update(item)
            else:
                self._visit(item, stack)
        return self.digest.hexdigest()

    def _visit(self, obj: Any, stack: list[object]) -> None:
        self.count += 1
        if self.count > self.limit:
            raise _TooBig()
        atom = _atom(obj)
        if atom is not None:
            self.digest.update(atom)
            return
        ref = self.seen.get(id(obj))
        if ref is not None:
            self.digest.update(b"r%d;" % ref)
            return
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        kind = type(obj)
        children: list[object]
        flat = _flat(obj, kind) if kind in _CONTAINERS else None
        if flat is not None:
            self.digest.update(flat)
            return
        if kind is list or kind is tuple:
            head, children = (b"L" if kind is list else b"T"), list(obj)
        elif kind is dict:
            head, children = b"D", [part for pair in obj.items() for part in pair]
        elif kind is set or kind is frozenset:
            head, children = b"S" + self._members(obj) + b";", []
        elif isinstance(obj, _BY_REFERENCE) or (kind is types.FunctionType
                                                and obj.__globals__ is not self.user_ns):
            head, children = _qualified(obj), []
        elif kind is types.FunctionType:
            head, children = b"F", self._function(obj)
        elif kind is types.CodeType:
            head, children = b"C" + obj.co_code, self._code(obj)
        elif self.np is not None and kind is self.np.ndarray:
            head, children = self._array(obj)
        else:
            head, children = self._reduced(obj)
        self.digest.update(head + b"%d[" % len(children))
        stack.append(_Token(b"]"))
        stack.extend(reversed(children))

    def _members(self, items: set[object] | frozenset[object]) -> bytes:
        digests = []
        for item in items:
            sub = _Walker(self.user_ns, self.limit - self.count)
            digests.append(sub.run(item))
            self.count += sub.count
        return ",".join(sorted(digests)).encode()

    def _function(self, func: Any) -> list[object]:
        closure = []
        for cell in func.__closure__ or ():
            try:
                closure.append(cell.cell_contents)
            except ValueError:
                closure.append(_Token(b"<empty>"))
        return [func.__code__, func.__name__, func.__qualname__, func.__defaults__,
                func.__kwdefaults__, closure, dict(func.__dict__)]

    @staticmethod
    def _code(code: types.CodeType) -> list[object]:
        return [code.co_consts, code.co_names, code.co_varnames, code.co_freevars,
                code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                code.co_kwonlyargcount, code.co_flags, code.co_name]

    def _array(self, array: Any) -> tuple[bytes, list[object]]:
        np = self.np
        head = f"N{array.dtype!r}{array.shape}".encode()
        if array.dtype.hasobject:
            items = array.ravel().tolist()
            flat = _flat(items, list)
            return (head + flat, []) if flat is not None else (head, items)
        if array.nbytes <= tokens.FULL_LIMIT:
            data = np.ascontiguousarray(array).tobytes()
            return head + tokens.sha256(data).encode(), []
        picked = array.flat[np.linspace(0, array.size - 1, _SAMPLE_ELEMENTS).astype(np.intp)]
        return head + tokens.sample(memoryview(picked.tobytes())).encode(), []

    def _reduced(self, obj: object) -> tuple[bytes, list[object]]:
        try:
            reduced = quirks.reduce(obj) or obj.__reduce_ex__(4)
        except Exception:
            return b"?" + _qualified(type(obj)), []
        if isinstance(reduced, str):
            return _qualified(type(obj)) + reduced.encode(), []
        self.keep.append(reduced)
        parts = list(reduced) + [None] * (5 - len(reduced))
        func, args, state, items, pairs = parts[:5]
        if type(state) is dict and all(type(key) is str for key in state):
            # a __setstate__ may reorder attributes; some are bookkeeping
            state = quirks.shape_state(obj, dict(sorted(state.items())))
        children: list[object] = [func, args, state]
        children.append(list(items) if items is not None else None)
        children.append([part for pair in pairs for part in pair] if pairs is not None else None)
        self.keep.append(children)
        return b"R", children


def shape(value: object, user_ns: Mapping[str, Any], limit: int = LIMIT) -> str | None:
    """The value's structural digest, or None past ``limit`` objects or on any error."""
    try:
        return _Walker(user_ns, limit).run(value)
    except _TooBig:
        return None
    except Exception:  # a __reduce_ex__ or a container that broke mid-walk
        return None
