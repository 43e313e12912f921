"""restore(): rebuild a namespace from a flushed manifest in a fresh kernel.

Everything is loaded into a staging dict first, so a corrupt snapshot leaves
the namespace untouched; a single group that does not load is reported lost,
because losing one variable beats refusing to resume the rest. The report never
calls a name restored unless its value was checked equal to the one saved
(:mod:`nbfleet.kernel.verify`): the others are in ``lost`` with
``"status": "changed"`` and a reason (and listed in ``changed``), because the
agent passes ``lost`` on to the API and to the notebook's resume message.
The kernel's settings come back too (``settings``; failures in ``lost``).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbfleet.kernel import codec, manifest, settings, verify
from nbfleet.kernel.blobs import BlobStore, Ref, decode_inline
from nbfleet.kernel.capture import OUT, Capture, Failed, Record, Saved
from nbfleet.kernel.cycle import is_pseudo

log = logging.getLogger("nbfleet.kernel")

REPORT = "restore-report.json"


def empty_report() -> dict[str, Any]:
    return {"restored": [], "changed": [], "recomputed": [], "lost": [], "settings": [],
            "imports": [], "bytes": 0, "seconds": 0.0}


class _Parts:
    """Blob contents read up front, in parallel; each use gets its own buffer so
    two equal arrays restored from one blob do not share memory."""

    def __init__(self, store: BlobStore, shas: set[str]) -> None:
        self._data: dict[str, bytearray | OSError] = {}
        self._used: set[str] = set()
        workers = min(8, (os.cpu_count() or 2) * 2, max(1, len(shas)))
        with ThreadPoolExecutor(workers, thread_name_prefix="nbfleet-restore") as pool:
            for sha, data in zip(shas, pool.map(self._read(store), shas), strict=True):
                self._data[sha] = data

    @staticmethod
    def _read(store: BlobStore) -> Any:
        def read(sha: str) -> bytearray | OSError:
            try:
                return store.read(sha)
            except OSError as error:
                return error
        return read

    def fetch(self, ref: Ref) -> bytearray:
        if "inline" in ref:
            return decode_inline(ref)
        sha = ref["blob"]
        data = self._data[sha]
        if isinstance(data, OSError):
            raise data
        if sha in self._used:
            return bytearray(data)
        self._used.add(sha)
        return data


def _replay_imports(statements: list[str]) -> list[str]:
    """Run the recorded imports for their side effects (``import a.b`` makes
    ``a.b`` exist); the bound names themselves come back as values."""
    done = []
    scratch: dict[str, Any] = {"__builtins__": builtins, "__name__": "__main__"}
    for statement in statements:
        try:
            exec(compile(statement, "<nbfleet import>", "exec"), scratch)
        except Exception as error:
            log.warning("nbfleet: replaying %r failed: %s", statement, error)
        else:
            done.append(statement)
    return done


def _lost(name: str, kind: str, reason: str) -> dict[str, str]:
    return {"name": name, "type": kind, "reason": reason}


def _all_refs(doc: dict[str, Any]) -> list[Ref]:
    entries = [*(v for v in doc.get("values", {}).values() if "stream" in v),
               *doc.get("groups", [])]
    if "settings" in doc:
        entries.append(doc["settings"])
    return [ref for entry in entries for ref in [entry["stream"], *entry.get("buffers", [])]]


def restore(shell: Any, state_dir: Path, capture: Capture | None,
            budget_s: float = 10.0) -> dict[str, Any]:
    """``budget_s``: how long re-running cells (for unpicklable values) may take in all."""
    started = time.perf_counter()
    path = state_dir / "manifest.json"
    if not path.exists():
        report = empty_report()
    else:
        report = _restore(shell, manifest.read(path), BlobStore(state_dir / "blobs"), capture,
                          budget_s)
    report["seconds"] = round(time.perf_counter() - started, 6)
    if state_dir.is_dir():
        manifest.write_json_atomic(state_dir / REPORT, report)
    return report


@dataclass
class Applied:
    """What a restore loaded into the namespace, for the next standby apply
    (``delta``) to start from."""

    doc: dict[str, Any]
    settings: dict[str, Any]
    recomputed: list[str] = field(default_factory=list)
    replay_lost: list[dict[str, str]] = field(default_factory=list)
    #: Every value came back equal to what was saved: a later apply may keep them.
    clean: bool = True


def group_key(names: tuple[str, ...], entry: dict[str, Any]) -> str:
    """Equal for a group whose names and pickles are the same (blobs are named by
    content): its objects need not be loaded again."""
    return json.dumps([list(names), entry.get("pickler"), entry.get("stream"),
                       entry.get("buffers")], sort_keys=True)


def groups_of(doc: dict[str, Any]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """The snapshot's groups that hold values, then its values saved alone."""
    values: dict[str, dict[str, Any]] = doc.get("values", {})
    found = []
    for index, group in enumerate(doc.get("groups", [])):
        names = tuple(group["names"])
        if any(values.get(n, {}).get("group") == index for n in names):
            found.append((names, group))
    found += [((name,), entry) for name, entry in sorted(values.items()) if "group" not in entry]
    return found


class _Loaded:
    """The groups of a snapshot, decoded: values staged, each with its pickle.
    ``keep``: keys (``group_key``) of groups already in the namespace, not loaded."""

    def __init__(self, doc: dict[str, Any], parts: _Parts,
                 keep: frozenset[str] = frozenset()) -> None:
        self.values: dict[str, dict[str, Any]] = doc.get("values", {})
        self.staged: dict[str, Any] = {}
        self.lost: list[dict[str, str]] = []
        self.groups: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.bytes = 0
        for names, entry in groups_of(doc):
            if group_key(names, entry) not in keep:
                self._load(names, entry, parts)

    def _load(self, names: tuple[str, ...], entry: dict[str, Any], parts: _Parts) -> None:
        try:
            decoded = codec.decode_group(entry, parts.fetch, len(names))
        except Exception as error:
            for name in names:
                if name in self.values:
                    self.lost.append(_lost("Out" if is_pseudo(name) else name,
                                           self.values[name]["type"],
                                           f"could not be loaded: {error!r}"))
            return
        self.staged.update(zip(names, decoded, strict=True))
        self.groups.append((names, entry))
        self.bytes += int(entry.get("size", 0))


def _restore(shell: Any, doc: dict[str, Any], store: BlobStore,
             capture: Capture | None, budget_s: float) -> dict[str, Any]:
    if capture is not None:
        capture.quiesce()
    lost = [_lost(name, str(info.get("type", "?")), str(info.get("reason", "")))
            for name, info in doc.get("lost", {}).items()]
    parts = _Parts(store, {ref["blob"] for ref in _all_refs(doc) if "blob" in ref})
    config = settings.Outcome()
    setting_doc: dict[str, Any] = {}
    with codec.loading_into(shell.user_ns):
        if "settings" in doc:
            try:
                decoded = codec.decode(doc["settings"], parts.fetch)
                setting_doc = decoded if isinstance(decoded, dict) else {}
            except Exception as error:
                config.fail("settings", f"could not be loaded: {error!r}")
        baseline = capture.baseline if capture is not None else None
        if setting_doc and baseline is not None:
            config = settings.prepare(setting_doc, baseline)  # paths before imports
        imports = _replay_imports(doc.get("imports", []))
        loaded = _Loaded(doc, parts)
    del parts
    lost += loaded.lost
    staged = loaded.staged
    outputs = staged.pop(OUT, None)
    shell.user_ns.update(staged)  # all at once: nothing half-restored

    # Recipes run after the values are in place: they read some of them (copied).
    from nbfleet.kernel import replay  # only on restore: kernels start lighter

    kinds: dict[str, str] = doc.get("recipe_types", {})
    definitions: dict[str, str] = doc.get("definitions", {})
    outcome = replay.replay(doc.get("recipes", {}), kinds, shell.user_ns, definitions, budget_s)
    recomputed = outcome.values
    lost.extend(outcome.lost)
    shell.user_ns.update(recomputed)

    changed = _verify(shell, loaded, outputs, lost)
    finished = settings.finish(shell, setting_doc, outputs if isinstance(outputs, dict) else None)
    config.done += finished.done
    config.lost += finished.lost
    lost += config.lost

    if capture is not None:
        _adopt(capture, doc, loaded, outputs, recomputed, outcome.programs, imports, lost,
               changed, setting_doc)
        capture.applied = Applied(doc, setting_doc, sorted(recomputed), list(outcome.lost),
                                  clean=not changed and not loaded.lost and not config.lost)
    restored = sorted(n for n in staged if n not in changed)
    return {
        "restored": restored,
        "changed": sorted(n if not is_pseudo(n) else "Out" for n in changed),
        "recomputed": sorted(recomputed),
        "lost": sorted(lost, key=lambda item: item["name"]),
        "settings": config.done,
        "imports": imports,
        "bytes": loaded.bytes,
        "seconds": 0.0,
    }


def _verify(shell: Any, loaded: _Loaded, outputs: object,
            lost: list[dict[str, str]]) -> set[str]:
    """Names restored but not equal to what was saved, each added to ``lost``."""
    changed: set[str] = set()
    for names, entry in loaded.groups:
        values = [outputs if name == OUT else loaded.staged[name] for name in names]
        infos = [loaded.values.get(name, {}) for name in names]
        reasons = verify.check(names, values, infos, entry["pickler"], shell.user_ns)
        for name, reason in reasons.items():
            changed.add(name)
            label = "Out" if is_pseudo(name) else name
            kind = str(loaded.values.get(name, {}).get("type", "?"))
            lost.append({"name": label, "type": kind, "reason": reason, "status": "changed"})
    return changed


def _adopt(capture: Capture, doc: dict[str, Any], loaded: _Loaded, outputs: object,
           recomputed: dict[str, Any], programs: dict[str, list[str]], imports: list[str],
           lost: list[dict[str, str]], changed: set[str], setting_doc: dict[str, Any]) -> None:
    """The restored state is the capture's from now on: unchanged groups keep their blobs."""
    records: dict[str, Record] = {}
    for names, entry in loaded.groups:
        values = [outputs if name == OUT else loaded.staged[name] for name in names]
        infos = [loaded.values.get(name, {}) for name in names]
        saved = Saved(names, {k: v for k, v in entry.items() if k in _PICKLE_KEYS},
                      tuple(info.get("type", "?") for info in infos),
                      tuple(id(value) for value in values),
                      tuple(info.get("digest", "") for info in infos),
                      tuple(info.get("shape") for info in infos), 0.0)
        records.update(dict.fromkeys(names, saved))
    records.update({name: Failed(codec.type_name(value), "recomputed on restore", id(value))
                    for name, value in recomputed.items()})
    capture.adopt(records, imports,
                  {n: frozenset(f) for n, f in doc.get("footprints", {}).items()},
                  {name: programs[name] for name in recomputed},
                  doc.get("definitions", {}),
                  {item["name"]: {"type": item["type"], "reason": item["reason"]}
                   for item in lost if item["name"] not in capture.shell.user_ns
                   and item.get("type") != settings.SETTING
                   and item["name"] != "Out" and not item["name"].startswith("Out[")
                   and "status" not in item},
                  changed)
    if setting_doc:
        capture.calls = settings.CallLog(setting_doc.get("ipython", {}).get("calls", []))


_PICKLE_KEYS = frozenset({"pickler", "stream", "buffers", "size"})
