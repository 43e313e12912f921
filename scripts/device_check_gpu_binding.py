"""Per-cell GPU binding on real NVIDIA hardware (run where there is a GPU and torch).

What CI cannot show without a GPU: that the kernel extension's binding
(``nbfleet/kernel/gpu.py``) is what CUDA and PyTorch actually obey. Each "cell"
runs between the extension's own ``pre_run_cell`` and ``post_run_cell`` hooks,
with the binding in its request metadata, as in a kernel::

    PYTHONPATH=src python3 scripts/device_check_gpu_binding.py

Exits non-zero, naming the check, if a claim does not hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from nbfleet.kernel.gpu import BINDING_KEY, GpuBinder

CHILD = ("import torch; print(torch.cuda.device_count(), "
         "torch.cuda.get_device_properties(0).uuid if torch.cuda.device_count() else '-')")


class Shell:
    events = SimpleNamespace(register=lambda *a: None, unregister=lambda *a: None)
    kernel = None


def cell(binder: GpuBinder, indices: list[int] | None, code: str) -> dict[str, Any]:
    meta = {} if indices is None else {BINDING_KEY: {
        "task_id": "k/1", "host_id": "h", "gpu_indices": indices, "gpu_type": "H100"}}
    info = SimpleNamespace(cell_meta=meta)
    binder.pre_run_cell(info)
    scope: dict[str, Any] = {}
    try:
        exec(code, scope)
    finally:
        binder.post_run_cell(SimpleNamespace(info=info))
    return scope


def child() -> str:
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          check=True).stdout.strip()


def check(what: str, ok: bool, detail: object) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
    if not ok:
        sys.exit(1)


def main() -> None:
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout.strip().splitlines()
    print("host GPUs:", gpus)
    names = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    before = {name: os.environ.get(name) for name in names}  # a container may set some
    print("the process's own variables:", before)
    binder = GpuBinder(Shell())
    # A cell bound to no GPUs (a GPU workspace's cell that binds none) sees none, in
    # its own process's children too.
    seen = cell(binder, [], "import subprocess, sys\n"
                "out = subprocess.run([sys.executable, '-c', CHILD], capture_output=True,"
                " text=True).stdout.strip()".replace("CHILD", repr(CHILD)))
    check("a cell bound to no GPUs: its subprocess sees none", seen["out"].startswith("0 "),
          seen["out"])
    # A cell bound to GPU 0: torch in the kernel initializes CUDA on it, a child too.
    first_uuid = gpus[0].split(", ")[1]
    seen = cell(binder, [0], "import os, torch, subprocess, sys\n"
                "x = torch.ones(1024, device='cuda') * 2\n"
                "env = os.environ['CUDA_VISIBLE_DEVICES']\n"
                "count = torch.cuda.device_count()\n"
                "uuid = str(torch.cuda.get_device_properties(0).uuid)\n"
                "total = float(x.sum())\n"
                "out = subprocess.run([sys.executable, '-c', CHILD], capture_output=True,"
                " text=True).stdout.strip()".replace("CHILD", repr(CHILD)))
    check("CUDA_VISIBLE_DEVICES in the bound cell", seen["env"] == "0", seen["env"])
    check("torch sees exactly the bound GPU", seen["count"] == 1, seen["count"])
    check("it is the host's GPU 0 (PCI order)", first_uuid.endswith(seen["uuid"][-12:]),
          (seen["uuid"], first_uuid))
    check("the cell's work ran on it", seen["total"] == 2048.0, seen["total"])
    check("a subprocess of the cell sees the bound GPU", seen["out"].startswith("1 "),
          seen["out"])
    after = {name: os.environ.get(name) for name in names}
    check("the variables are put back after the cell", after == before, after)
    check("a later cell with no binding sees the process's own variables",
          cell(binder, None, "import os\nv = os.environ.get('CUDA_VISIBLE_DEVICES')")["v"]
          == before["CUDA_VISIBLE_DEVICES"], before["CUDA_VISIBLE_DEVICES"])
    # CUDA initialized with GPU 0 visible: a cell bound to GPU 0 again selects it.
    seen = cell(binder, [0], "import torch\nd = torch.cuda.current_device()\n"
                "y = float((torch.ones(8, device='cuda') + 1).sum())")
    check("torch's cached CUDA context keeps serving the bound GPU",
          seen["d"] == 0 and seen["y"] == 16.0, {"device": seen["d"], "sum": seen["y"]})
    print("all checks passed on", gpus[0])


if __name__ == "__main__":
    main()
