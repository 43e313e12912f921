"""Which objects make two names one object graph, and the union of such names.

Names are pickled together (one pickle, one memo) when their values share an
object whose identity matters: ``l1 = l2``, a view and its base, ``ax.figure``
and ``fig``, two frames with one index. The objects a pickle memoized are
exactly what it reached, so the memo is the walk: no separate traversal. Values
whose identity carries no meaning (strings, numbers, tuples, classes and
functions pickled by reference, dtypes, enum members, immutable scalars) are left
out, or every group holding the string ``"x"`` or ``float`` would be one.
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterable, Mapping
from operator import itemgetter
from typing import Any

_NO_IDENTITY: frozenset[type] = frozenset({
    str, bytes, tuple, frozenset, int, float, complex, bool, type(None), range, slice,
    type(Ellipsis), type(NotImplemented), types.CodeType, types.ModuleType,
    types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
    types.MethodDescriptorType, types.ClassMethodDescriptorType, types.GetSetDescriptorType,
    types.MemberDescriptorType, types.MappingProxyType, types.CellType,
})
#: Modules of immutable value types (dates, decimals, fractions), by name: no import.
_VALUE_MODULES = frozenset({"datetime", "decimal", "_decimal", "_pydecimal", "fractions"})


def _immutable_library_types() -> tuple[type, ...]:
    """NumPy dtypes and scalars, pandas scalars: immutable, often library singletons."""
    found: list[type] = []
    np: Any = sys.modules.get("numpy")
    if np is not None:
        found += [np.dtype, np.generic]
    pd: Any = sys.modules.get("pandas")
    if pd is not None:
        found += [pd.Timestamp, pd.Timedelta, pd.Period, pd.Interval, type(pd.NaT), type(pd.NA)]
    return tuple(found)


class IdentityFilter:
    """Whether sharing an object of a type between two names must survive a restore."""

    def __init__(self, user_ns: Mapping[str, Any]) -> None:
        self._user_ns = user_ns
        self._library = _immutable_library_types()

    def bears(self, kind: type) -> bool:
        if (kind in _NO_IDENTITY or issubclass(kind, type | enum.Enum)
                or kind.__module__ in _VALUE_MODULES):
            return False
        return not (self._library and issubclass(kind, self._library))

    def objects(self, memo: Mapping[int, tuple[int, object]]) -> list[object]:
        """The identity-bearing objects of a pickler's memo (``pickler.memo.copy()``):
        types are judged once each, objects filtered at C speed (a column of 200,000
        strings costs milliseconds). Functions count if defined in a cell: others are
        pickled by reference."""
        objects = list(map(itemgetter(1), memo.values()))
        kinds = {kind for kind in set(map(type, objects)) if self.bears(kind)}
        return [obj for obj in objects if type(obj) in kinds and (
            type(obj) is not types.FunctionType
            or getattr(obj, "__globals__", None) is self._user_ns)]


class Unions:
    """Union-find over group indices, fed with the objects each group reached.

    The caller keeps every fed object alive until it is done (a freed object's id
    can be reused by another group's object and fake a link)."""

    def __init__(self) -> None:
        self._parent: list[int] = []
        self._owner: dict[int, int] = {}

    def add(self, objects: Iterable[object]) -> int:
        index = len(self._parent)
        self._parent.append(index)
        for obj in objects:
            other = self._owner.setdefault(id(obj), index)
            if other != index:
                self._join(other, index)
        return index

    def find(self, index: int) -> int:
        while self._parent[index] != index:
            self._parent[index] = self._parent[self._parent[index]]
            index = self._parent[index]
        return index

    def _join(self, a: int, b: int) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            self._parent[max(root_a, root_b)] = min(root_a, root_b)

    def classes(self) -> list[list[int]]:
        """Every set of joined indices, smallest index first, in order."""
        found: dict[int, list[int]] = {}
        for index in range(len(self._parent)):
            found.setdefault(self.find(index), []).append(index)
        return list(found.values())
