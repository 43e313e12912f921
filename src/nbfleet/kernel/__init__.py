"""Code loaded inside user kernels: capture of in-memory state for suspend/resume,
and each cell's GPU binding (:mod:`nbfleet.kernel.gpu`).

The agent starts kernels with ``--ext nbfleet.kernel`` and ``NBFLEET_STATE_DIR``
set; the extension then keeps ``<dir>/blobs`` up to date in the background and
the agent calls :func:`flush` / :func:`restore` through silent execute requests.
This module stays import-light (stdlib, cloudpickle; dill on demand) because
every kernel start pays for it.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any

from nbfleet.kernel import gpu as _gpu
from nbfleet.kernel import restore as _restore
from nbfleet.kernel import snapshot as _snapshot
from nbfleet.kernel import streams as _streams
from nbfleet.kernel.blobs import INLINE_LIMIT
from nbfleet.kernel.capture import Capture
from nbfleet.kernel.gpu import current_binding

__all__ = ["INLINE_LIMIT", "apply", "checkpoint", "current_binding", "flush",
           "load_ipython_extension", "restore", "unload_ipython_extension"]

log = logging.getLogger("nbfleet.kernel")

STATE_DIR_ENV = "NBFLEET_STATE_DIR"
PREIMPORT_ENV = "NBFLEET_PREIMPORT"

_capture: Capture | None = None
_shell: Any = None


def _preimport(spec: str) -> list[str]:
    """Warm ``sys.modules`` without binding user names; failures are ignored."""
    done = []
    for name in (part.strip() for part in spec.split(",")):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # a warm-up, never a reason to fail the kernel
            log.info("nbfleet: preimport of %s failed: %s", name, error)
        else:
            done.append(name)
    return done


def _state_dir() -> Path | None:
    value = os.environ.get(STATE_DIR_ENV)
    return Path(value) if value else None


def load_ipython_extension(ip: Any) -> None:
    global _capture, _shell
    _gpu.load(ip)  # with or without state capture: a GPU cell needs its devices
    _streams.bound_output()
    _preimport(os.environ.get(PREIMPORT_ENV, ""))
    if _capture is not None:
        return
    _shell = ip
    state_dir = _state_dir()
    if state_dir is None:
        log.warning("nbfleet: %s is not set; kernel state will not be captured", STATE_DIR_ENV)
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    capture = Capture(ip, state_dir)
    capture.checkpoint_writer = lambda seq, epoch: _snapshot.checkpoint(capture, seq, epoch)
    capture.checkpoint_dropped = (
        lambda seq, reason: _snapshot.mark_checkpoint(capture, seq, False, reason))
    capture.start()
    _capture = capture


def unload_ipython_extension(ip: Any) -> None:
    global _capture, _shell
    capture, _capture, _shell = _capture, None, None
    _gpu.unload()
    if capture is not None:
        capture.stop()


def _active() -> Capture | None:
    """The running capture; loads the extension if a kernel was started without it."""
    if _capture is None and _shell is None and _state_dir() is not None:
        try:
            from IPython import get_ipython
        except ImportError:
            return None
        ip = get_ipython()
        if ip is not None:
            load_ipython_extension(ip)
    return _capture


def flush() -> dict[str, Any]:
    """Write ``<STATE_DIR>/manifest.json`` for the namespace as it is now."""
    capture = _active()
    if capture is None:
        return {"names": 0, "bytes": 0, "blobs": [], "lost": []}
    return _snapshot.flush(capture)


def checkpoint(seq: int) -> bool:
    """Have the state written in the background, as it is now (the agent, after a
    cell); ``<STATE_DIR>/checkpoint.json`` says when it is done. False: no capture."""
    capture = _active()
    if capture is None:
        return False
    capture.request_checkpoint(seq)
    return True


def apply() -> dict[str, Any]:
    """Bring a standby's namespace forward to ``<STATE_DIR>/manifest.json``, a later
    checkpoint of the one it holds (:mod:`nbfleet.kernel.delta`); ``{"fresh": why}``
    where that would not be exact."""
    capture = _active()
    state_dir = _state_dir()
    from nbfleet.kernel import delta  # standbys only: kernels start lighter

    if state_dir is None:
        return {"fresh": "no state directory in this kernel"}
    if capture is None:
        return delta.refuse(state_dir, "no state capture in this kernel")

    return delta.apply(capture.shell, state_dir, capture)


def restore(replay_budget_s: float | None = None) -> dict[str, Any]:
    """Load ``<STATE_DIR>/manifest.json`` into the user namespace; ValueError if corrupt.

    Re-running cells for values that cannot be pickled may take ``replay_budget_s``
    seconds in all (default: ``NBFLEET_REPLAY_BUDGET_S``, else 10).
    """
    capture = _active()
    state_dir = _state_dir()
    if capture is None or state_dir is None:
        return _restore.empty_report()
    from nbfleet.kernel.replay import budget_from_env  # loaded on restore only

    budget = replay_budget_s if replay_budget_s and replay_budget_s > 0 else budget_from_env()
    return _restore.restore(capture.shell, state_dir, capture, budget)
