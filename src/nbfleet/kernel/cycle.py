"""One pass over the namespace: pickle what changed, check the rest, join what shares.

After each cell (on the capture worker) and at every flush (exactly, on the
main thread) a cycle:

1. re-pickles every group holding a name the cell (re)bound or may have mutated;
2. re-pickles the other groups as a check, cheapest first, and keeps the result
   if its digest moved: an object changed through a name no cell mentioned
   (``b['k'].append(2)`` changes ``a``), an iterator consumed, a figure drawn on
   through pyplot. A background check spends at most :data:`CHECK_BUDGET_S` in
   all and skips groups whose last pickle took over :data:`MAX_CHECK_S`, and it
   reuses the sha256 of big buffers whose address, size and 256 KiB sample did not
   change (so a group holding a 1 GB array costs a pickle, not a hash of it);
   a flush checks every group and hashes every byte, so what a flush writes is
   never stale;
3. joins groups whose pickles reached a common object (see
   :mod:`nbfleet.kernel.graph`) and pickles each union as one group. Groups
   only grow: a name whose value no longer shares anything stays in its group
   (which costs pickling the group together, never correctness).

Pickling happens in C and holds the GIL: a check delays the next cell's start by
at most the one pickle in progress (bounded by :data:`MAX_CHECK_S` for checks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbfleet.kernel import codec, shape, tokens
from nbfleet.kernel.blobs import BlobStore
from nbfleet.kernel.graph import Unions

CHECK_BUDGET_S = 0.25
MAX_CHECK_S = 0.05
TRACK_LIMIT = 50_000
"""In the background, a pickle of more objects than this is not looked into for
objects shared with other groups (its memo would cost tens of ms to copy): the
flush does it."""
OUT = "<Out>"
"""The pseudo-name of ``Out``: pickled with the names, as its values are often theirs."""


def is_pseudo(name: str) -> bool:
    return name.startswith("<")


#: Values whose pickle a restore itself moves on (a figure's canvas connects new
#: callbacks, takes a number): pickled after the others in a group.
_RESTLESS = ("matplotlib",)


def order(names: set[str] | tuple[str, ...] | list[str],
          values: Mapping[str, object] | None = None) -> tuple[str, ...]:
    """Names in pickling order. A name's slice of a group's pickle refers back to
    objects in earlier slices, so a slice that differs after a restore casts doubt
    on every later one (:mod:`nbfleet.kernel.verify`): values that restore the same
    go first, figures after them, pseudo-names (``Out``) last."""
    def rank(name: str) -> tuple[int, str]:
        if is_pseudo(name):
            return 2, name
        module = type(values[name]).__module__ if values and name in values else ""
        return (1 if module.startswith(_RESTLESS) else 0), name

    return tuple(sorted(names, key=rank))


@dataclass(frozen=True)
class Saved:
    """One group of names pickled together."""

    names: tuple[str, ...]
    entry: codec.Entry
    types: tuple[str, ...]
    ids: tuple[int, ...]
    digests: tuple[str, ...]
    shapes: tuple[str | None, ...]
    seconds: float


@dataclass(frozen=True)
class Failed:
    type: str
    reason: str
    obj_id: int


Record = Saved | Failed


@dataclass
class _Result:
    record: Record
    names: tuple[str, ...]
    reached: list[object] | None


class Cycle:
    def __init__(self, records: Mapping[str, Record], roots: dict[str, object],
                 dirty: set[str], user_ns: Mapping[str, Any], store: BlobStore,
                 cache: tokens.ShaCache | None, valid: Callable[[], bool]) -> None:
        """``cache`` None: a flush (every group, every byte); ``valid``: False once the
        cycle's view of the namespace may be torn (a cell started)."""
        self.records = records
        self.roots = roots
        self.dirty = dirty
        self.user_ns = user_ns
        self.store = store
        self.cache = cache
        self.valid = valid
        self.dropped_outputs: dict[str, dict[str, str]] = {}
        self._unmergeable: set[tuple[str, ...]] = set()

    # -- planning --------------------------------------------------------------

    def _plan(self) -> tuple[list[tuple[str, ...]], list[tuple[tuple[str, ...], float]]]:
        exact = self.cache is None
        changed: list[tuple[str, ...]] = []
        clean: list[tuple[tuple[str, ...], float]] = []
        seen: set[str] = set()
        for name in order(list(self.roots)):
            if name in seen:
                continue
            record = self.records.get(name)
            if isinstance(record, Saved):
                members = order([m for m in record.names if m in self.roots], self.roots)
                seen.update(members)
                moved = members != record.names or any(
                    not is_pseudo(m) and id(self.roots[m]) != record.ids[record.names.index(m)]
                    for m in members)
                if exact or moved or any(m in self.dirty for m in members):
                    changed.append(members)
                else:
                    clean.append((members, record.seconds))
                continue
            seen.add(name)
            if (exact or record is None or name in self.dirty
                    or record.obj_id != id(self.roots[name])):
                changed.append((name,))
        clean.sort(key=lambda item: item[1])
        return changed, clean

    # -- pickling --------------------------------------------------------------

    def _encode(self, names: tuple[str, ...], filtered: bool = False) -> list[_Result]:
        values = [self.roots[name] for name in names]
        try:
            encoded = codec.encode_group(values, self.user_ns, self.store, self.cache,
                                         track=0 if self.cache is None else TRACK_LIMIT)
        except codec.Unpicklable as error:
            if len(names) > 1:  # find who cannot be pickled; the rest join again later
                return [result for name in names for result in self._encode((name,))]
            if names[0] == OUT and isinstance(values[0], dict) and values[0] and not filtered:
                return self._encode_outputs(values[0])
            return [_Result(Failed(codec.type_name(values[0]), str(error), id(values[0])),
                            names, [])]
        shapes = self._shapes(names, values, encoded.digests)
        saved = Saved(names, encoded.entry, tuple(codec.type_name(v) for v in values),
                      tuple(id(v) for v in values), encoded.digests, shapes, encoded.seconds)
        return [_Result(saved, names, encoded.reached)]

    def _encode_outputs(self, outputs: dict[Any, object]) -> list[_Result]:
        """``Out`` without the outputs that cannot be pickled (reported, by number)."""
        kept: dict[Any, object] = {}
        for key, value in outputs.items():
            try:
                codec.encode_group([value], self.user_ns, None)
            except codec.Unpicklable as error:
                self.dropped_outputs[f"Out[{key}]"] = {
                    "type": codec.type_name(value), "reason": f"cannot be pickled ({error})"}
            else:
                kept[key] = value
        self.roots[OUT] = kept
        return self._encode((OUT,), filtered=True)

    def _shapes(self, names: tuple[str, ...], values: list[object],
                digests: tuple[str, ...]) -> tuple[str | None, ...]:
        """Structural digests. A name's slice of the pickle can only refer back to
        earlier slices, so its shape is reused while its slice and every earlier one
        keep their digests (``Out`` goes last: its changes never cost a name's shape)."""
        old = self.records.get(names[0])
        found: list[str | None] = []
        same = isinstance(old, Saved)
        for index, (name, value, digest) in enumerate(zip(names, values, digests, strict=True)):
            same = (same and isinstance(old, Saved) and index < len(old.names)
                    and old.names[index] == name and old.digests[index] == digest)
            if same and isinstance(old, Saved) and old.shapes[index] is not None:
                found.append(old.shapes[index])
            else:
                found.append(shape.shape(value, self.user_ns))
        return tuple(found)

    # -- the pass --------------------------------------------------------------

    def run(self) -> dict[str, Record] | None:
        """Records for every name pickled or checked; None if a cell started meanwhile."""
        changed, clean = self._plan()
        results: list[_Result] = []
        for names in changed:
            results += self._encode(names)
            if not self.valid():
                return None
        spent = 0.0
        for names, cost in clean:
            if self.cache is not None and (cost > MAX_CHECK_S or spent + cost > CHECK_BUDGET_S):
                continue
            started = time.perf_counter()
            results += self._encode(names)
            spent += time.perf_counter() - started
            if not self.valid():
                return None
        merged = self._merge(results)
        if merged is None:
            return None
        if self.cache is not None:
            self.cache.prune()
        return {name: result.record for result in merged for name in result.names}

    def _merge(self, results: list[_Result]) -> list[_Result] | None:
        for _ in range(8):  # each round only grows groups; a handful always suffices
            unions = Unions()
            for result in results:
                unions.add(result.reached or ())
            joined = [indices for indices in unions.classes() if len(indices) > 1]
            if not joined:
                return results
            done: set[int] = set()
            fresh: list[_Result] = []
            for indices in joined:
                names = order([n for i in indices for n in results[i].names], self.roots)
                if names in self._unmergeable:
                    continue
                parts = self._encode(names)
                if len(parts) != 1 or not isinstance(parts[0].record, Saved):
                    self._unmergeable.add(names)  # pickled apart, but not together
                    continue
                done.update(indices)
                fresh += parts
                if not self.valid():
                    return None
            if not fresh:
                return results
            results = [r for i, r in enumerate(results) if i not in done] + fresh
        return results
