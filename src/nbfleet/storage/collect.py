"""Snapshot data nothing can name any more, deleted.

A kernel's state is saved after every cell (``agent/checkpoints.py``) and at each
suspend. Values are content-addressed, so what did not change is stored once; but
every value that changed leaves its old blob behind, and a notebook that updates
a 1 GB model in each cell would leave a gigabyte per cell. A manifest that a
checkpoint replaced is deleted by its agent; the blobs it named never were.

Collection is safe only while nothing writes the workspace's snapshots: an upload
skips a blob that exists (``upload_state``), so a blob deleted between that check
and the manifest's record would leave a snapshot naming a missing blob. So it runs
where no runtime of the workspace exists and none can start: in a suspend, after
the agent has saved and released, before the workspace is marked suspended
(``control/collection.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import workspace_prefix
from nbfleet.storage.snapshots import parse_manifest, read_manifest, referenced_blobs

#: Deletes between two checks that the collection may go on (S3 takes 1,000 a request).
BATCH = 1000


@dataclass(frozen=True, slots=True)
class Collected:
    manifests: int = 0
    blobs: int = 0
    bytes: int = 0
    #: Told to stop before it had deleted everything.
    stopped: bool = False


def snapshot_keys(snapshot: dict[str, Any] | None) -> set[str]:
    """The store keys a workspace's ``snapshot`` record names: each kernel's manifest
    and the package layer."""
    if not snapshot:
        return set()
    keys = {str(k["key"]) for k in (snapshot.get("kernels") or {}).values()
            if isinstance(k, dict) and k.get("key")}
    if snapshot.get("packages"):
        keys.add(str(snapshot["packages"]))
    return keys


def collect(store: BlobStore, workspace_id: str, keep: Iterable[str],
            proceed: Callable[[], bool] = lambda: True) -> Collected:
    """Delete the workspace's manifests and blobs that no key in ``keep`` names.

    ``keep`` holds manifest keys (``.../snapshots/...``) and blob keys (a package
    layer, ``.../cas/...``). A kept manifest that cannot be read stops the whole
    collection before anything is deleted (``CorruptSnapshot``): the snapshot is
    then broken already, and what is left may be all there is to recover it from.
    ``proceed`` is asked before each batch of deletes: False stops the collection
    there (``stopped``), as when its caller no longer holds the workspace.
    """
    prefix = workspace_prefix(workspace_id)
    manifests_at, blobs_at = f"{prefix}/snapshots", f"{prefix}/cas"
    kept = set(keep)
    named: set[str] = set()
    for key in kept:
        if key.startswith(f"{manifests_at}/"):
            manifest = parse_manifest(read_manifest(store, workspace_id, key))
            named.update(referenced_blobs(manifest))
        elif key.startswith(f"{blobs_at}/"):
            named.add(key.rsplit("/", 1)[-1])
        else:
            raise ValueError(f"{key!r} is not a snapshot key of {workspace_id}")
    manifests = [info for info in store.list(manifests_at)
                 if f"{manifests_at}/{info.key}" not in kept]
    blobs = [info for info in store.list(blobs_at)
             if info.key.rsplit("/", 1)[-1] not in named]
    # Manifests first: a crash between the two leaves blobs nothing names, which the
    # next collection finds, never a manifest whose blobs are gone.
    doomed = [(f"{manifests_at}/{i.key}", i.size, True) for i in manifests] + \
        [(f"{blobs_at}/{i.key}", i.size, False) for i in blobs]
    done = Collected()
    for start in range(0, len(doomed), BATCH):
        if not proceed():
            return replace(done, stopped=True)
        batch = doomed[start:start + BATCH]
        store.delete_many([key for key, _, _ in batch])
        gone = sum(1 for *_, manifest in batch if manifest)
        done = Collected(done.manifests + gone, done.blobs + len(batch) - gone,
                         done.bytes + sum(size for _, size, _ in batch))
    return done
