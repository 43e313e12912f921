"""The cell's GPUs, inside the kernel: dynamic binding (see DESIGN.md, "GPU efficiency").

The control plane puts a binding in each GPU cell's ``execute_request`` metadata
(``nbfleet.protocol.gpu.CellBinding`` under ``nbfleet_binding``). Before the cell
runs, its GPUs are exposed through ``CUDA_VISIBLE_DEVICES`` and
``NVIDIA_VISIBLE_DEVICES`` (the cell's code and every process it starts see
them) and, when torch has already initialized CUDA (it reads the variables only
once), through ``torch.cuda.set_device``; after the cell the variables are put
back, because the GPUs are released with the reply. A cell without a binding
costs a dict lookup. Stdlib only: every kernel start imports this module, so the
binding is checked here rather than with the pydantic model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("nbfleet.kernel")

#: ``nbfleet.protocol.gpu.BINDING_KEY`` (not imported: that module needs pydantic).
BINDING_KEY = "nbfleet_binding"
#: The same bounds as the agent's (``nbfleet.agent.bindings``).
MAX_GPUS = 256
MAX_GPU_INDEX = 4096
#: Set while a bound cell runs, then put back. ``PCI_BUS_ID`` makes CUDA number
#: the GPUs as ``nvidia-smi`` (and the host's inventory) does.
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


@dataclass(frozen=True, slots=True)
class Binding:
    """The GPUs the running cell may use (read-only: :func:`current_binding`)."""

    task_id: str
    host_id: str
    gpu_indices: tuple[int, ...]
    gpu_type: str = ""


def parse_binding(raw: object) -> Binding | None:
    """The binding, or None if ``raw`` is not a well-formed one (then nothing is bound)."""
    if not isinstance(raw, dict):
        return None
    indices = raw.get("gpu_indices", [])
    task_id, host_id = raw.get("task_id"), raw.get("host_id")
    gpu_type = raw.get("gpu_type", "")
    if not (isinstance(indices, list) and len(indices) <= MAX_GPUS
            and all(type(i) is int and 0 <= i < MAX_GPU_INDEX for i in indices)
            and len(set(indices)) == len(indices)):
        return None
    if not (isinstance(task_id, str) and 0 < len(task_id) <= 200
            and isinstance(host_id, str) and 0 < len(host_id) <= 100
            and isinstance(gpu_type, str) and len(gpu_type) <= 200):
        return None
    return Binding(task_id, host_id, tuple(indices), gpu_type)


def binding_env(binding: Binding) -> dict[str, str]:
    """The variables a bound cell runs with (no GPUs: CUDA sees none)."""
    joined = ",".join(str(i) for i in binding.gpu_indices)
    return {"CUDA_VISIBLE_DEVICES": joined, "NVIDIA_VISIBLE_DEVICES": joined or "none",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _visible(value: str | None) -> tuple[int, ...] | None:
    """Parsed ``CUDA_VISIBLE_DEVICES`` (None: all GPUs, or ids that are not indices)."""
    if value is None:
        return None
    try:
        return tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        return None


class GpuBinder:
    """The ``pre_run_cell``/``post_run_cell`` hooks of one shell.

    A stack, because a cell may run cells (``get_ipython().run_cell``); each entry
    is matched to its ``post_run_cell`` by the ExecutionInfo both events carry.
    """

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        #: (the cell's ExecutionInfo, the variables before it, its binding)
        self._stack: list[tuple[object, dict[str, str | None], Binding]] = []
        #: The GPU indices CUDA saw when torch initialized it ("unknown": not yet).
        self._cuda_init: tuple[int, ...] | str | None = "unknown"

    @property
    def current(self) -> Binding | None:
        return self._stack[-1][2] if self._stack else None

    def register(self) -> None:
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def unregister(self) -> None:
        for event, hook in (("pre_run_cell", self.pre_run_cell),
                            ("post_run_cell", self.post_run_cell)):
            with contextlib.suppress(ValueError):
                self.shell.events.unregister(event, hook)
        while self._stack:
            self._restore(self._stack.pop()[1])

    def _metadata(self, info: object) -> object:
        """The request's metadata: IPython >= 9 passes it with the cell; before
        that (or for a cell run by a cell) it is the kernel's current shell parent."""
        meta = getattr(info, "cell_meta", None)
        if meta is not None:
            return meta
        kernel = getattr(self.shell, "kernel", None)
        try:
            parent = kernel.get_parent("shell") if kernel is not None else None
        except Exception:  # an ipykernel without get_parent (< 6): no binding support
            return None
        return parent.get("metadata") if isinstance(parent, dict) else None

    def pre_run_cell(self, info: object) -> None:
        meta = self._metadata(info)
        raw = meta.get(BINDING_KEY) if isinstance(meta, dict) else None
        if raw is None:
            return
        binding = parse_binding(raw)
        if binding is None:
            log.warning("nbfleet: ignoring a malformed GPU binding")
            return
        self._observe_cuda()  # initialized outside a cell: with the kernel's own variables
        self._stack.append((info, {name: os.environ.get(name) for name in ENV_NAMES}, binding))
        os.environ.update(binding_env(binding))
        self._select_torch_device(binding)

    def post_run_cell(self, result: object) -> None:
        if not self._stack:
            return
        self._observe_cuda()  # initialized by this cell: with its variables
        info = getattr(result, "info", None)
        if result is not None and not any(entry[0] is info for entry in self._stack):
            return  # a cell that fired no pre_run_cell (empty), or one without a binding
        while self._stack:
            entry_info, saved, _ = self._stack.pop()
            self._restore(saved)
            if result is None or entry_info is info:
                break

    @staticmethod
    def _restore(saved: dict[str, str | None]) -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def _observe_cuda(self) -> None:
        """Remember which GPUs CUDA saw when torch initialized it: later ordinals
        number those, whatever ``CUDA_VISIBLE_DEVICES`` says now."""
        if self._cuda_init != "unknown":
            return
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_initialized():
                self._cuda_init = _visible(os.environ.get("CUDA_VISIBLE_DEVICES"))
        except Exception:  # a broken or fake torch: nothing to select
            return

    def _select_torch_device(self, binding: Binding) -> None:
        torch = sys.modules.get("torch")  # never imported here: the user's choice
        if torch is None or not binding.gpu_indices or self._cuda_init == "unknown":
            return
        first = binding.gpu_indices[0]
        seen = self._cuda_init
        if isinstance(seen, tuple) and first not in seen:
            print(f"nbfleet: CUDA was initialized in this kernel with GPUs "
                  f"{','.join(map(str, seen)) or 'none'}; this cell's GPU {first} is not "
                  f"reachable from torch until the kernel restarts.", file=sys.stderr)
            return
        try:
            torch.cuda.set_device(seen.index(first) if isinstance(seen, tuple) else first)
        except Exception as exc:
            log.warning("nbfleet: torch.cuda.set_device(%s) failed: %s", first, exc)


_binder: GpuBinder | None = None


def current_binding() -> Binding | None:
    """The running cell's GPU binding (None: it has none, or no cell is running)."""
    return _binder.current if _binder is not None else None


def load(shell: Any) -> None:
    """Install the hooks on ``shell`` (once; a second load is a no-op)."""
    global _binder
    if _binder is not None and _binder.shell is shell:
        return
    unload()
    _binder = GpuBinder(shell)
    _binder.register()


def unload() -> None:
    """Remove the hooks and put back any variables a running cell had changed."""
    global _binder
    binder, _binder = _binder, None
    if binder is not None:
        binder.unregister()
