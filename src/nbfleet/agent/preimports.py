"""Which modules a snapshot needs, so that its kernel imports them before the resume.

A restore replays the notebook's imports and unpickles values whose classes live in
modules (scikit-learn, SymPy, SciPy): seconds of imports on the critical path of a
resume. The agent reads the snapshot's manifest (JSON: data, never code) and has
those modules imported early: by a warm kernel prepared for this import set before
the resume (``warmpool``), and by the claimed kernel while its snapshot downloads
(``statesync``).

Safety: the names come from a user's snapshot. One is kept only if it is a plain
dotted identifier whose module file exists in the kernel's own base environment
(the interpreter's standard library and site-packages, found by looking at files:
nothing is imported in the agent), and is not provided by the workspace's own
package layer. The imports run inside the sandboxed kernel. A warm kernel prepared
for an import set goes only to a workspace whose own set contains it, so no
workspace ever holds a module that another one chose.
"""

from __future__ import annotations

import functools
import importlib.machinery
import json
import logging
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nbfleet.agent.slots import WARM_IMPORTS
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.snapshots import CorruptSnapshot, read_manifest

log = logging.getLogger(__name__)

DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*", re.ASCII)
#: At most this many modules per snapshot (the rest load as the restore needs them).
MAX_MODULES = 64
MAX_STATEMENT = 1000
#: Never imported ahead: they print or open things on import, are the kernel itself,
#: or are always loaded (``builtins`` is where ``int`` and ``dict`` values come from).
DENIED = frozenset({"__main__", "this", "antigravity", "__hello__", "__phello__", "nbfleet",
                    "builtins", "sys"})
_SUFFIXES = tuple(importlib.machinery.all_suffixes())
#: Names in a package layer that are no module (pip's metadata and scripts).
_LAYER_METADATA = (".dist-info", ".egg-info", ".data", ".pth", ".egg-link")


def statement_modules(statement: str) -> list[str]:
    """The modules one recorded import statement loads (``ast.unparse`` form):
    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule; one that
    is not is dropped when the environment is checked). Relative imports give none."""
    text = " ".join(statement.split())
    if len(text) > MAX_STATEMENT:
        return []
    if text.startswith("import "):
        names = [part.split(" as ")[0].strip() for part in text[len("import "):].split(",")]
        return [name for name in names if DOTTED.fullmatch(name)]
    if text.startswith("from "):
        module, found, rest = text[len("from "):].partition(" import ")
        module = module.strip()
        if not found or not DOTTED.fullmatch(module):
            return []
        subs = [f"{module}.{part.split(' as ')[0].strip()}"
                for part in rest.strip().strip("()").split(",")]
        return [module, *(sub for sub in subs if DOTTED.fullmatch(sub))]
    return []


def type_module(type_name: str) -> str:
    """The module a captured value's class comes from (``pkg.mod.Class`` -> ``pkg.mod``)."""
    return type_name.rpartition(".")[0]


@dataclass(frozen=True)
class BaseEnvironment:
    """The directories a kernel imports the platform's packages from, looked at as files."""

    roots: tuple[str, ...]
    builtin: frozenset[str]

    @classmethod
    def of_kernels(cls) -> BaseEnvironment:
        """Kernels run this interpreter (``slots.kernel_env`` puts its bin first)."""
        paths = sysconfig.get_paths()
        roots = [paths["stdlib"], paths["platstdlib"],
                 os.path.join(paths["platstdlib"], "lib-dynload"),
                 paths["purelib"], paths["platlib"]]
        return cls(tuple(dict.fromkeys(r for r in roots if os.path.isdir(r))),
                   frozenset(sys.builtin_module_names))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one per agent: lives as long
    def has(self, dotted: str) -> bool:
        """Whether ``dotted`` is a module (or package) file there; imports nothing."""
        parts = dotted.split(".")
        if len(parts) == 1 and parts[0] in self.builtin:
            return True
        return any(_found(root, parts) for root in self.roots)


def _found(root: str, parts: list[str]) -> bool:
    here = root
    for index, part in enumerate(parts):
        path = os.path.join(here, part)
        if os.path.isdir(path):
            here = path
            continue
        return index == len(parts) - 1 and any(os.path.isfile(path + s) for s in _SUFFIXES)
    return True


@dataclass(frozen=True)
class Needs:
    """What a snapshot's kernel will import: ``modules`` in the order recorded, and
    ``profile``, those worth a prepared warm kernel: not the standard library (fast
    to import) and not what every warm kernel already has."""

    modules: tuple[str, ...] = ()
    profile: frozenset[str] = frozenset()


NOTHING = Needs()
_WARM_TOPS = frozenset(name.split(".")[0] for name in WARM_IMPORTS)


def needs(manifest: Mapping[str, Any], env: BaseEnvironment,
          shadowed: frozenset[str] = frozenset()) -> Needs:
    """The modules a manifest's imports and values come from, found in ``env`` and
    not among ``shadowed`` (top-level names the workspace's layer provides: those
    load from the layer, during the restore)."""
    candidates: list[str] = []
    imports = manifest.get("imports")
    if isinstance(imports, list):
        for statement in imports:
            if isinstance(statement, str):
                candidates.extend(statement_modules(statement))
    values = manifest.get("values")
    if isinstance(values, dict):
        for entry in values.values():
            kind = entry.get("type") if isinstance(entry, dict) else None
            if isinstance(kind, str) and len(kind) <= MAX_STATEMENT:
                candidates.append(type_module(kind))
    modules: list[str] = []
    for name in dict.fromkeys(candidates):
        top = name.split(".")[0]
        if (DOTTED.fullmatch(name) and top not in DENIED and top not in shadowed
                and env.has(name)):
            modules.append(name)
            if len(modules) == MAX_MODULES:
                break
    heavy = frozenset(name for name in modules
                      if name.split(".")[0] not in sys.stdlib_module_names | _WARM_TOPS)
    return Needs(tuple(modules), heavy)


def parse_manifest(raw: bytes | None) -> dict[str, Any]:
    """The manifest as a dict; empty when there is none or it does not parse (the
    restore reports a corrupt snapshot itself)."""
    if not raw:
        return {}
    try:
        document = json.loads(raw)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def layer_modules(path: str) -> frozenset[str]:
    """Top-level module names a package layer provides (names only: nothing in the
    directory, which its kernel owns, is opened or followed)."""
    try:
        entries = os.listdir(path)
    except OSError:
        return frozenset()
    tops = set()
    for name in entries:
        if name.endswith(_LAYER_METADATA) or name in ("bin", "__pycache__"):
            continue
        top = name.split(".")[0]
        if DOTTED.fullmatch(top):
            tops.add(top)
    return frozenset(tops)


def shadowed(modules: Iterable[str], layer: frozenset[str]) -> bool:
    """Whether a kernel that imported ``modules`` from the base environment holds one
    the workspace's layer replaces (it must be restarted to load the layer's)."""
    return any(name.split(".")[0] in layer for name in modules)


def preimport_code(modules: Iterable[str]) -> str:
    """The silent request that imports ``modules`` in a kernel, skipping failures
    (a module whose import fails is left to the restore, which reports it)."""
    names = [name for name in modules if DOTTED.fullmatch(name)]
    spec = ",".join(names)  # a literal (repr), whatever the names: never code
    return ("__import__('importlib').invalidate_caches()\n"
            f"__import__('nbfleet.kernel').kernel._preimport({spec!r})")


def snapshot_needs(store: BlobStore, workspace_id: str, keys: Mapping[str, str],
                   env: BaseEnvironment, shadowed: frozenset[str] = frozenset(),
                   ) -> dict[str, Needs]:
    """kernel id -> what its snapshot (blob key) will import; a snapshot that cannot
    be read needs nothing here (its restore reports it)."""
    out: dict[str, Needs] = {}
    for kernel_id, key in keys.items():
        try:
            raw = read_manifest(store, workspace_id, key)
        except (CorruptSnapshot, OSError) as exc:
            log.info("snapshot %s of %s not read ahead: %s", key, workspace_id, exc)
            continue
        out[kernel_id] = needs(parse_manifest(raw), env, shadowed)
    return out
