"""restore(): rebuild a namespace from a flushed manifest in a fresh kernel.

Everything is loaded into a staging dict first, so a corrupt snapshot leaves
the namespace untouched; a single value that does not load is reported lost,
because losing one variable beats refusing to resume the rest.
"""

from __future__ import annotations

import builtins
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nbfleet.kernel import codec, manifest
from nbfleet.kernel.blobs import BlobStore, Ref, decode_inline
from nbfleet.kernel.capture import Capture, Failed, Pickled, Record

log = logging.getLogger("nbfleet.kernel")

REPORT = "restore-report.json"


def empty_report() -> dict[str, Any]:
    return {"restored": [], "recomputed": [], "lost": [], "imports": [], "bytes": 0,
            "seconds": 0.0}


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


def _restore(shell: Any, doc: dict[str, Any], store: BlobStore,
             capture: Capture | None, budget_s: float) -> dict[str, Any]:
    if capture is not None:
        capture.quiesce()
    lost = [_lost(name, str(info.get("type", "?")), str(info.get("reason", "")))
            for name, info in doc.get("lost", {}).items()]
    imports = _replay_imports(doc.get("imports", []))

    values: dict[str, dict[str, Any]] = doc.get("values", {})
    shas = {ref["blob"] for entry in values.values()
            for ref in [entry["stream"], *entry.get("buffers", [])] if "blob" in ref}
    parts = _Parts(store, shas)
    staged: dict[str, Any] = {}
    loaded_bytes = 0
    with codec.loading_into(shell.user_ns):
        for name in sorted(values):
            entry = values[name]
            try:
                staged[name] = codec.decode(entry, parts.fetch)
            except Exception as error:
                lost.append(_lost(name, entry["type"], f"could not be loaded: {error!r}"))
            else:
                loaded_bytes += int(entry.get("size", 0))
    del parts
    shell.user_ns.update(staged)  # all at once: nothing half-restored

    # Recipes run after the values are in place: they read some of them (copied).
    from nbfleet.kernel import replay  # only on restore: kernels start lighter

    kinds: dict[str, str] = doc.get("recipe_types", {})
    definitions: dict[str, str] = doc.get("definitions", {})
    outcome = replay.replay(doc.get("recipes", {}), kinds, shell.user_ns, definitions, budget_s)
    recomputed = outcome.values
    lost.extend(outcome.lost)
    shell.user_ns.update(recomputed)

    if capture is not None:
        records: dict[str, Record] = {name: Pickled(values[name], id(value))
                                      for name, value in staged.items()}
        records.update({name: Failed(codec.type_name(value), "recomputed on restore", id(value))
                        for name, value in recomputed.items()})
        capture.adopt(records, imports,
                      {n: frozenset(f) for n, f in doc.get("footprints", {}).items()},
                      {name: outcome.programs[name] for name in recomputed}, definitions,
                      {item["name"]: {"type": item["type"], "reason": item["reason"]}
                       for item in lost if item["name"] not in shell.user_ns})
    return {
        "restored": sorted(staged),
        "recomputed": sorted(recomputed),
        "lost": sorted(lost, key=lambda item: item["name"]),
        "imports": imports,
        "bytes": loaded_bytes,
        "seconds": 0.0,
    }
