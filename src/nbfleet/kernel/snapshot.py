"""flush(): turn the capture state into manifest.json plus the blobs it references."""

from __future__ import annotations

import time
from typing import Any

from nbfleet.kernel import manifest
from nbfleet.kernel.blobs import Ref, blob_shas
from nbfleet.kernel.capture import Capture, Failed, Pickled


def _refs(entry: dict[str, Any]) -> list[Ref]:
    return [entry["stream"], *entry["buffers"]]


def build(capture: Capture) -> dict[str, Any]:
    """The manifest document for the namespace as it is now (pickles what is dirty)."""
    from nbfleet.kernel import purity  # only when a snapshot is taken: kernels start lighter

    records = capture.settle()
    unpicklable = {name for name, record in records.items() if isinstance(record, Failed)}
    values: dict[str, Any] = {}
    recipes: dict[str, list[str]] = {}
    recipe_types: dict[str, str] = {}
    lost: dict[str, dict[str, str]] = {}
    env = purity.Namespace(capture.shell.user_ns, capture.definitions)
    for name in sorted(records):
        record = records[name]
        if isinstance(record, Pickled):
            values[name] = record.entry
            continue
        recipe = capture.recipes.recipe(name, unpicklable)
        if not recipe.sources:
            lost[name] = {"type": record.type,
                          "reason": f"cannot be pickled ({record.reason}) and cannot be "
                                    f"recomputed: {recipe.reason}"}
            continue
        verdict = purity.check(recipe.sources, env)
        if verdict.safe:
            recipes[name] = list(verdict.program)
            recipe_types[name] = record.type
        else:
            lost[name] = {"type": record.type,
                          "reason": f"cannot be pickled ({record.reason}); "
                                    + purity.not_rerun(verdict.reason)}
    for name, info in capture.still_lost.items():
        if name not in records:
            lost.setdefault(name, dict(info))
    shas = blob_shas(ref for entry in values.values() for ref in _refs(entry))
    return {
        "format": manifest.FORMAT,
        "created": time.time(),
        "imports": list(capture.imports),
        "values": values,
        "recipes": recipes,
        "recipe_types": recipe_types,
        "lost": lost,
        "footprints": {name: sorted(footprint)
                       for name, footprint in sorted(capture.footprints.items())
                       if name in records},
        "definitions": {name: source for name, source in sorted(capture.definitions.items())
                        if name in records},
        "blobs": sorted(shas),
    }


def flush(capture: Capture) -> dict[str, Any]:
    """Write ``manifest.json`` atomically, drop unreferenced blobs, summarize."""
    document = build(capture)
    capture.state_dir.mkdir(parents=True, exist_ok=True)
    manifest.write_json_atomic(capture.state_dir / "manifest.json", document)
    capture.store.collect(document["blobs"])
    store = capture.store
    inline = sum(store.size(ref) for entry in document["values"].values()
                 for ref in _refs(entry) if "inline" in ref)
    blob_bytes = sum(store.size({"blob": sha}) for sha in document["blobs"])
    return {
        "names": len(document["values"]) + len(document["recipes"]),
        "bytes": inline + blob_bytes,
        "blobs": document["blobs"],
        "lost": sorted(document["lost"]),
    }
