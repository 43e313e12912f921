"""Run inside a kernel (through ``runpy``, so it adds no names to the notebook):
what a user's names hold and which objects they share, read independently of
nbfleet's own digests so that a wrong "restored" cannot agree with itself.

Sharing is read by walking each name two steps deep (attributes, dict values,
list items) and noting every object reached from two names, or from two places;
arrays count as shared when their memory overlaps. Immutable values (numbers,
strings, tuples, classes, dtypes) are walked through but never counted: their
identity cannot change what a notebook computes. A path is a list of steps, so
the other kernel can follow it.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
from typing import Any

DEPTH = 2
NODES_PER_NAME = 400
ITEMS = 50
ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
ATOMIC = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset, range,
          type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
          types.MethodType, types.MethodWrapperType, types.WrapperDescriptorType,
          types.GetSetDescriptorType, types.MemberDescriptorType, types.CodeType,
          property, staticmethod, classmethod, slice)


def user_names(ns: dict[str, Any]) -> list[str]:
    shell = ns.get("get_ipython")
    hidden = shell().user_ns_hidden if callable(shell) else {}
    return sorted(name for name, value in ns.items()
                  if not name.startswith("_") and name not in hidden
                  and name not in ("In", "Out", "exit", "quit", "get_ipython")
                  and not isinstance(value, types.ModuleType))


def names(ns: dict[str, Any]) -> str:
    return json.dumps(user_names(ns))


def _numpy() -> Any:
    import sys
    return sys.modules.get("numpy")


def _pandas() -> Any:
    import sys
    return sys.modules.get("pandas")


def _content(value: Any, depth: int = 0) -> str:
    """Text that changes whenever the value does (within reason), without addresses."""
    np, pd = _numpy(), _pandas()
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return f"ndarray{value.shape}:{ADDRESS.sub('@', repr(value.tolist()))}"
        data = np.ascontiguousarray(value).tobytes()
        return f"ndarray{value.shape}{value.dtype}:{hashlib.sha256(data).hexdigest()}"
    if pd is not None and isinstance(value, (pd.DataFrame, pd.Series, pd.Index)):
        index = value if isinstance(value, pd.Index) else value.index
        names = [repr(list(index.names))]
        if isinstance(value, pd.DataFrame):
            names += [repr(value.columns.tolist()), repr(list(value.columns.names))]
        try:
            hashed = pd.util.hash_pandas_object(value, index=True).to_numpy().tobytes()
            body = hashlib.sha256(hashed).hexdigest()
        except TypeError:  # unhashable cells (lists, dicts)
            body = ADDRESS.sub("@", value.to_string())
        return f"{type(value).__name__}{value.shape}{names}{value.dtypes if hasattr(value, 'dtypes') else ''}:{body}"  # noqa: E501
    if hasattr(value, "get_axes") and hasattr(value, "savefig"):  # a matplotlib figure
        axes = [(ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), len(ax.lines),
                 len(ax.patches), len(ax.texts), len(ax.collections))
                for ax in value.get_axes()]
        return f"figure{value.get_size_inches().tolist()}{axes}"
    if hasattr(value, "get_figure") and hasattr(value, "stale"):  # another artist
        # What shows, not its caches and callbacks (which a restore rebuilds).
        parts = [type(value).__qualname__, str(value.get_label())]
        if hasattr(value, "get_xlabel"):  # axes
            parts += [value.get_title(), value.get_xlabel(), value.get_ylabel(),
                      str(len(value.lines)), str(len(value.patches)), str(len(value.texts))]
        if hasattr(value, "get_texts"):
            parts += [text.get_text() for text in value.get_texts()]
        return "artist:" + "|".join(parts)
    if isinstance(value, (list, dict)) and depth < 2:
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        return "[" + ",".join(f"{k!r}:{_content(v, depth + 1)}" for k, v in items[:200]) + "]"
    try:
        text = repr(value)
    except Exception as error:  # a repr that raises is still a fingerprint
        text = f"<repr raised {type(error).__name__}>"
    fields = ""
    if depth < 2 and not isinstance(value, ATOMIC) and hasattr(value, "__dict__"):
        try:
            attributes = sorted(vars(value).items())[:40]
        except TypeError:
            attributes = []
        fields = ";".join(f"{k}={_content(v, depth + 1)}" for k, v in attributes
                          if not k.startswith("__"))
    return f"{type(value).__qualname__}:{ADDRESS.sub('@', text[:2000])}|{fields}"


def fingerprints(ns: dict[str, Any]) -> str:
    prints = {}
    for name in user_names(ns):
        value = ns[name]
        if isinstance(value, types.GeneratorType) or type(value).__name__.endswith("iterator"):
            prints[name] = type(value).__qualname__  # reading it would consume it
            continue
        prints[name] = hashlib.sha256(_content(value).encode()).hexdigest()
    return json.dumps(prints)


def _children(value: Any) -> list[tuple[list[Any], Any]]:
    if isinstance(value, dict):
        return [(["item", key], item) for key, item in list(value.items())[:ITEMS]
                if isinstance(key, (str, int))]
    if isinstance(value, (list, tuple)):
        return [(["item", index], item) for index, item in enumerate(value[:ITEMS])]
    if isinstance(value, ATOMIC) or not hasattr(value, "__dict__"):
        return []
    try:
        attributes = vars(value)
    except TypeError:
        return []
    return [(["attr", key], item) for key, item in list(attributes.items())[:ITEMS]
            if isinstance(key, str)]


def _walk(ns: dict[str, Any]) -> list[tuple[list[list[Any]], Any]]:
    """(path, object) for every countable object two steps from a user's name."""
    reached: list[tuple[list[list[Any]], Any]] = []
    for name in user_names(ns):
        frontier: list[tuple[list[list[Any]], Any]] = [([["name", name]], ns[name])]
        seen: set[int] = set()
        for depth in range(DEPTH + 1):
            following = []
            for path, value in frontier:
                if id(value) in seen or len(seen) >= NODES_PER_NAME:
                    continue
                seen.add(id(value))
                if not isinstance(value, ATOMIC):
                    reached.append((path, value))
                if depth < DEPTH:
                    following += [([*path, step], child) for step, child in _children(value)]
            frontier = following
    return reached


def relations(ns: dict[str, Any]) -> str:
    """Pairs of paths that reach one object, or arrays whose memory overlaps."""
    np = _numpy()
    first: dict[int, list[list[Any]]] = {}
    pairs = []
    arrays: list[tuple[list[list[Any]], Any]] = []
    for path, value in _walk(ns):
        if np is not None and isinstance(value, np.ndarray):
            arrays.append((path, value))
        elif id(value) in first:
            if first[id(value)][0] != path[0]:  # across names: within one is the pickle's
                pairs.append(["same", first[id(value)], path])
        else:
            first[id(value)] = path
    for i, (path_a, a) in enumerate(arrays):
        for path_b, b in arrays[i + 1:]:
            if path_a[0] != path_b[0] and a.size and b.size and np.may_share_memory(a, b):
                pairs.append(["memory", path_a, path_b])
    return json.dumps(pairs)


def _follow(ns: dict[str, Any], path: list[list[Any]]) -> Any:
    value: Any = None
    for kind, key in path:
        if kind == "name":
            value = ns[key]
        elif kind == "item":
            value = value[key]
        else:
            value = vars(value)[key]
    return value


def broken(ns: dict[str, Any], pairs_json: str, names_json: str) -> str:
    """The relations of ``pairs_json`` between ``names_json`` that no longer hold."""
    np = _numpy()
    names = set(json.loads(names_json))
    lost = []
    for kind, path_a, path_b in json.loads(pairs_json):
        if path_a[0][1] not in names or path_b[0][1] not in names:
            continue
        try:
            a, b = _follow(ns, path_a), _follow(ns, path_b)
        except (KeyError, IndexError, TypeError, AttributeError):
            lost.append([kind, path_a, path_b, "a path no longer exists"])
            continue
        holds = a is b if kind == "same" else bool(np.may_share_memory(a, b))
        if not holds:
            lost.append([kind, path_a, path_b, "separate objects now"])
    return json.dumps(lost)
