"""flush(): turn the capture state into manifest.json plus the blobs it references.

``values`` maps each name to its pickle: its own entry when it shares nothing,
else ``{"group": i}`` into ``groups``, one pickle for names whose objects are one
graph. Each name carries its ``digest`` (and ``shape`` when cheap enough), which
a restore compares before it calls the name restored. ``settings`` is the
kernel's configuration (see :mod:`nbfleet.kernel.settings`).

A flush checks every group exactly (:mod:`nbfleet.kernel.cycle`): everything is
pickled again and every buffer byte hashed (about a second per 1-2 GB of arrays),
and only what changed is written. That is the price of a snapshot that is never
stale, whatever a cell changed behind the scan's back.
"""

from __future__ import annotations

import time
from typing import Any

from nbfleet.kernel import codec, manifest, settings
from nbfleet.kernel.blobs import Ref, blob_shas
from nbfleet.kernel.capture import ABANDONED, OUT, Capture, Failed, Saved
from nbfleet.kernel.cycle import is_pseudo, order


def _refs(entry: dict[str, Any]) -> list[Ref]:
    return [entry["stream"], *entry["buffers"]]


def _encode_settings(capture: Capture) -> tuple[codec.Entry | None, dict[str, dict[str, str]]]:
    """The settings in one pickle; a part that cannot be pickled is left out, by name."""
    if capture.baseline is None:
        return None, {}
    doc = settings.capture(capture.shell, capture.baseline, capture.calls)
    ns, store = capture.shell.user_ns, capture.store
    lost: dict[str, dict[str, str]] = {}
    try:
        return codec.encode(doc, ns, store), lost
    except codec.Unpicklable:
        pass
    for outer in [doc, doc["ipython"]]:
        for key in list(outer):
            if key == "ipython" and outer is doc:
                continue
            try:
                codec.encode_group([outer[key]], ns, None)
            except codec.Unpicklable as error:
                del outer[key]
                lost[f"setting {key}"] = {"type": settings.SETTING,
                                          "reason": f"cannot be pickled ({error})"}
    try:
        return codec.encode(doc, ns, store), lost
    except codec.Unpicklable as error:
        return None, {"settings": {"type": settings.SETTING, "reason": str(error)}}


class Abandoned(Exception):
    """A cell started while a checkpoint was being taken: its view may be torn."""


def build(capture: Capture, epoch: int | None = None) -> dict[str, Any]:
    """The manifest document for the namespace as it is now (pickles what is dirty).
    ``epoch``: taken on the worker for a checkpoint; :class:`Abandoned` once a cell
    starts."""
    from nbfleet.kernel import purity  # only when a snapshot is taken: kernels start lighter

    settled = capture.settle(epoch)
    if settled is None:
        raise Abandoned()
    records = settled
    unpicklable = {name for name, record in records.items() if isinstance(record, Failed)}
    values: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    group_index: dict[int, int] = {}
    recipes: dict[str, list[str]] = {}
    recipe_types: dict[str, str] = {}
    lost: dict[str, dict[str, str]] = {}
    env = purity.Namespace(capture.shell.user_ns, capture.definitions)
    for name in order(list(records)):
        record = records[name]
        if isinstance(record, Saved):
            at = record.names.index(name)
            check = {"digest": record.digests[at]}
            found = record.shapes[at]
            if found is not None:
                check["shape"] = found
            if len(record.names) == 1:
                values[name] = {"type": record.types[at], **record.entry, **check}
                continue
            if id(record) not in group_index:
                group_index[id(record)] = len(groups)
                groups.append({**record.entry, "names": list(record.names)})
            values[name] = {"type": record.types[at], "group": group_index[id(record)], **check}
            continue
        if is_pseudo(name):
            lost["Out"] = {"type": record.type, "reason": f"cannot be pickled ({record.reason})"}
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
    if OUT in records:
        lost.update(capture.dropped_outputs)
    settings_entry, settings_lost = _encode_settings(capture)
    lost.update(settings_lost)
    entries = [*(v for v in values.values() if "stream" in v), *groups]
    if settings_entry is not None:
        entries.append(settings_entry)
    shas = blob_shas(ref for entry in entries for ref in _refs(entry))
    document: dict[str, Any] = {
        "format": manifest.FORMAT,
        "created": time.time(),
        "imports": list(capture.imports),
        "values": values,
        "groups": groups,
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
    if settings_entry is not None:
        document["settings"] = settings_entry
    return document


def flush(capture: Capture) -> dict[str, Any]:
    """Write ``manifest.json`` atomically, drop unreferenced blobs, summarize."""
    document = build(capture)
    capture.state_dir.mkdir(parents=True, exist_ok=True)
    manifest.write_json_atomic(capture.state_dir / "manifest.json", document)
    capture.store.collect(document["blobs"])
    store = capture.store
    entries = [*(v for v in document["values"].values() if "stream" in v), *document["groups"]]
    inline = sum(store.size(ref) for entry in entries for ref in _refs(entry) if "inline" in ref)
    blob_bytes = sum(store.size({"blob": sha}) for sha in document["blobs"])
    return {
        "names": sum(not is_pseudo(n) for n in document["values"]) + len(document["recipes"]),
        "bytes": inline + blob_bytes,
        "blobs": document["blobs"],
        "lost": sorted(document["lost"]),
    }


CHECKPOINT_MARK = "checkpoint.json"


def checkpoint(capture: Capture, seq: int, epoch: int) -> None:
    """On the capture's worker, between cells: write the manifest as :func:`flush`
    does, unless a cell starts first; then say how it went in ``checkpoint.json``
    (the agent waits for that ``seq``). The next cell never waits for it."""
    try:
        document = build(capture, epoch)
        capture.state_dir.mkdir(parents=True, exist_ok=True)
        staged = capture.state_dir / f".manifest-{seq}.json"
        manifest.write_json_atomic(staged, document)

        def commit() -> None:
            staged.replace(capture.state_dir / "manifest.json")
        if not capture.commit_if_valid(epoch, commit):
            staged.unlink(missing_ok=True)
            raise Abandoned()
        capture.store.collect(document["blobs"])
    except Abandoned:
        mark_checkpoint(capture, seq, False, ABANDONED)
    except Exception as error:  # the agent reports it; the kernel goes on
        mark_checkpoint(capture, seq, False, f"{type(error).__name__}: {error}"[:500])
    else:
        mark_checkpoint(capture, seq, True, None)


def mark_checkpoint(capture: Capture, seq: int, ok: bool, reason: str | None) -> None:
    """``abandoned``: given up for a cell, which is no failure (the agent reports one)."""
    capture.state_dir.mkdir(parents=True, exist_ok=True)
    manifest.write_json_atomic(capture.state_dir / CHECKPOINT_MARK,
                               {"seq": seq, "ok": ok, "reason": reason,
                                "abandoned": reason == ABANDONED})
