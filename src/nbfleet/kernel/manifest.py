"""manifest.json (format 1): reading it strictly, writing it atomically.

The agent moves manifests between machines; one that does not validate is a
corrupt snapshot, reported as ValueError before anything touches the namespace.
Format 1 grew ``groups`` (one pickle for several names), per-name ``digest`` and
``shape``, and ``settings``; manifests without them still read.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from nbfleet.kernel.blobs import SHA256_HEX

FORMAT = 1
PICKLERS = frozenset({"cloudpickle", "dill", "module"})


def write_json_atomic(path: Path, document: Any) -> None:
    """Readers see the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        json.dump(document, out, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"invalid manifest: {what}")


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _check_ref(ref: object, where: str) -> None:
    _check(isinstance(ref, dict) and len(ref) == 1, f"{where} is not a part reference")
    assert isinstance(ref, dict)
    if "blob" in ref:
        _check(isinstance(ref["blob"], str) and bool(SHA256_HEX.fullmatch(ref["blob"])),
               f"{where} names a bad blob")
    else:
        _check(isinstance(ref.get("inline"), str), f"{where} has no inline data or blob")


def _check_pickle(entry: dict[str, Any], what: str) -> None:
    _check(entry.get("pickler") in PICKLERS, f"{what} has an unknown pickler")
    _check_ref(entry.get("stream"), f"{what} stream")
    buffers = entry.get("buffers", [])
    _check(isinstance(buffers, list), f"{what} buffers is not a list")
    for index, ref in enumerate(buffers):
        _check_ref(ref, f"{what} buffer {index}")


def _check_value(name: str, entry: object, groups: list[Any]) -> None:
    what = f"value {name!r}"
    _check(isinstance(entry, dict), f"{what} is not an object")
    assert isinstance(entry, dict)
    _check(isinstance(entry.get("type"), str), f"{what} has no type")
    for key in ("digest", "shape"):
        _check(isinstance(entry.get(key, ""), str), f"{what} {key} is not a string")
    if "group" in entry:
        index = entry["group"]
        _check(type(index) is int and 0 <= index < len(groups)
               and name in groups[index]["names"], f"{what} names a group it is not in")
    else:
        _check_pickle(entry, what)


def _check_group(index: int, group: object) -> None:
    what = f"group {index}"
    _check(isinstance(group, dict), f"{what} is not an object")
    assert isinstance(group, dict)
    names: Any = group.get("names")
    _check(_is_str_list(names) and len(names) == len(set(names)) > 0, f"{what} has bad names")
    _check(group.get("pickler") != "module", f"{what} cannot be a module")
    _check_pickle(group, what)


def parse(text: str | bytes) -> dict[str, Any]:
    """Validate a manifest document; raises ValueError on anything unexpected."""
    try:
        doc: dict[str, Any] = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"invalid manifest: {error}") from None
    _check(isinstance(doc, dict), "not a JSON object")
    _check(doc.get("format") == FORMAT, f"format is {doc.get('format')!r}, not {FORMAT}")
    _check(_is_str_list(doc.get("imports", [])), "imports is not a list of strings")
    groups = doc.get("groups", [])
    _check(isinstance(groups, list), "groups is not a list")
    for index, group in enumerate(groups):
        _check_group(index, group)
    values = doc.get("values", {})
    _check(isinstance(values, dict), "values is not an object")
    for name, entry in values.items():
        _check_value(name, entry, groups)
    if "settings" in doc:
        _check(isinstance(doc["settings"], dict), "settings is not an object")
        _check_pickle(doc["settings"], "settings")
    recipes = doc.get("recipes", {})
    _check(isinstance(recipes, dict) and all(_is_str_list(v) for v in recipes.values()),
           "recipes is not an object of source lists")
    _check(isinstance(doc.get("recipe_types", {}), dict), "recipe_types is not an object")
    lost = doc.get("lost", {})
    _check(isinstance(lost, dict) and all(isinstance(v, dict) for v in lost.values()),
           "lost is not an object of objects")
    footprints = doc.get("footprints", {})
    _check(isinstance(footprints, dict) and all(_is_str_list(v) for v in footprints.values()),
           "footprints is not an object of name lists")
    definitions = doc.get("definitions", {})
    _check(isinstance(definitions, dict) and all(isinstance(v, str) for v in definitions.values()),
           "definitions is not an object of sources")
    _check(_is_str_list(doc.get("blobs", [])), "blobs is not a list of strings")
    return doc


def read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as error:
        raise ValueError(f"unreadable manifest: {error}") from None
    return parse(text)
