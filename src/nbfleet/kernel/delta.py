"""apply(): bring a standby's namespace forward to a later checkpoint of the same
kernel, loading only the groups that changed.

A standby replica (``agent/standbys.py``) keeps its kernel loaded with the
executor's last checkpoint, so that a failover finds the values in memory. Most
groups of a checkpoint are those of the one before (pickles are stored by
content, so an unchanged group has the same blobs): they keep their objects.
Groups that changed are loaded and verified as a restore does; names deleted
since are deleted; history, counter and RNGs follow.

What cannot be brought forward exactly answers ``{"fresh": reason}`` and changes
nothing: IPython settings, warning registries, the environment, directory or
``sys.path`` changed (undoing one is not always possible), cells to re-run for
unpicklable values changed or were re-run at the last load, an import was
undone, the output history was cleared, or the last load was not exact. The
agent then loads the checkpoint into a fresh kernel instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nbfleet.kernel import codec, manifest, settings
from nbfleet.kernel.blobs import BlobStore
from nbfleet.kernel.capture import OUT, Capture
from nbfleet.kernel.cycle import is_pseudo
from nbfleet.kernel.restore import (
    REPORT,
    Applied,
    _adopt,
    _all_refs,
    _Loaded,
    _Parts,
    _replay_imports,
    _verify,
    group_key,
    groups_of,
)

#: Parts of the snapshot that must be equal for an apply to be exact.
_FIXED = ("recipes", "recipe_types", "definitions", "footprints")
#: Settings a cell changes every time: ``settings.advance`` sets them.
_PER_CELL = frozenset({"inputs", "execution_count", "random", "numpy.random"})


def apply(shell: Any, state_dir: Path, capture: Capture) -> dict[str, Any]:
    started = time.perf_counter()
    doc = manifest.read(state_dir / "manifest.json")
    store = BlobStore(state_dir / "blobs")
    previous: Applied | None = capture.applied
    try:
        setting_doc = _settings(shell, doc, store)
    except Exception as error:
        return refuse(state_dir, f"its settings could not be loaded: {error!r}")
    reason = obstacle(previous, doc, setting_doc)
    if reason is not None or previous is None:
        return refuse(state_dir, reason or "nothing loaded yet")
    capture.quiesce()
    before = {group_key(names, entry) for names, entry in groups_of(previous.doc)}
    keyed = [(group_key(names, entry), names, entry) for names, entry in groups_of(doc)]
    keep = frozenset(key for key, _, _ in keyed if key in before)
    loading = [(names, entry) for key, names, entry in keyed if key not in keep]
    loading_names = {name for names, _ in loading for name in names}
    parts = _Parts(store, {ref["blob"] for _, entry in loading
                           for ref in [entry["stream"], *entry.get("buffers", [])]
                           if "blob" in ref})
    # Before decoding, as a restore does: a value may need a module's side effects.
    old_imports = set(previous.doc.get("imports", []))
    imports = _replay_imports([s for s in doc.get("imports", []) if s not in old_imports])
    with codec.loading_into(shell.user_ns):
        loaded = _Loaded(doc, parts, keep)
    del parts
    # From here the namespace changes: should anything below fail, what it holds is
    # neither checkpoint, and the next apply must not start from it.
    previous.clean = False
    removed = set(previous.doc.get("values", {})) - set(doc.get("values", {}))
    for name in removed:
        shell.user_ns.pop(name, None)
    capture.forget_names(removed)
    lost = [{"name": name, "type": str(info.get("type", "?")), "reason": str(info.get("reason"))}
            for name, info in doc.get("lost", {}).items()] + loaded.lost + previous.replay_lost
    staged = loaded.staged
    # A changed group that did not load must not keep its earlier value: a restore
    # of this checkpoint would not have the name at all.
    for name in loading_names - set(staged):
        shell.user_ns.pop(name, None)
    outputs = staged.pop(OUT, None)
    shell.user_ns.update(staged)
    changed = _verify(shell, loaded, outputs, lost)
    outcome = settings.advance(shell, setting_doc,
                               outputs if isinstance(outputs, dict) else None)
    lost += outcome.lost
    _adopt(capture, doc, loaded, outputs, {}, {}, imports, lost, changed, setting_doc)
    capture.applied = Applied(doc, setting_doc, [], previous.replay_lost,
                              clean=not changed and not loaded.lost and not outcome.lost)
    missing = {item["name"] for item in lost}
    report = {
        "restored": sorted(n for n in doc.get("values", {}) if not is_pseudo(n)
                           and n in shell.user_ns and n not in changed
                           and n not in missing),
        "changed": sorted(n if not is_pseudo(n) else "Out" for n in changed),
        "recomputed": [],  # an apply never recomputes (see obstacle)
        "lost": sorted(lost, key=lambda item: item["name"]),
        "settings": outcome.done,
        "imports": imports,
        "bytes": loaded.bytes,
        "delta": {"kept": len(keep), "loaded": len(loaded.groups), "removed": sorted(removed)},
        "seconds": round(time.perf_counter() - started, 6),
    }
    manifest.write_json_atomic(state_dir / REPORT, report)
    return report


def refuse(state_dir: Path, reason: str) -> dict[str, Any]:
    """Answer that the namespace is left as it is (the agent reads the report file)."""
    report = {"fresh": reason}
    manifest.write_json_atomic(state_dir / REPORT, report)
    return report


def obstacle(previous: Applied | None, doc: dict[str, Any],
             setting_doc: dict[str, Any]) -> str | None:
    """Why ``doc`` cannot be applied on top of ``previous`` exactly; None if it can."""
    if previous is None:
        return "nothing loaded yet"
    if not previous.clean:
        return "the last load was not exact"
    if previous.recomputed:
        # Re-run against the files the standby had then (open files, say): only a
        # restore with the files as they are now gives what a restore would.
        return "values were recomputed from their cells"
    if OUT in previous.doc.get("values", {}) and OUT not in doc.get("values", {}):
        return "the output history was cleared"
    for part in _FIXED:
        if not _same(previous.doc.get(part, {}), doc.get(part, {})):
            return f"{part.replace('_', ' ')} changed"
    if not set(previous.doc.get("imports", [])) <= set(doc.get("imports", [])):
        return "an import was undone"
    for part in sorted((set(previous.settings) | set(setting_doc)) - _PER_CELL):
        if not _same(previous.settings.get(part), setting_doc.get(part)):
            return f"settings changed ({part})"
    return None


def _same(a: object, b: object) -> bool:
    """Equality that never raises (an array's ``==`` is not a bool)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _settings(shell: Any, doc: dict[str, Any], store: BlobStore) -> dict[str, Any]:
    if "settings" not in doc:
        return {}
    refs = {ref["blob"] for ref in _all_refs({"settings": doc["settings"]}) if "blob" in ref}
    parts = _Parts(store, refs)
    with codec.loading_into(shell.user_ns):
        decoded = codec.decode(doc["settings"], parts.fetch)
    return decoded if isinstance(decoded, dict) else {}
