"""The kernel's per-cell GPU binding in a real IPython shell: the environment a bound
cell and its subprocesses see, and that it is put back afterwards."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from nbfleet.agent.bindings import parse_binding as agent_parse_binding
from nbfleet.kernel import gpu
from nbfleet.protocol.gpu import BINDING_KEY

NAMES = gpu.ENV_NAMES


def bound(*indices: int, task_id: str = "task_1") -> dict[str, Any]:
    return {BINDING_KEY: {"task_id": task_id, "host_id": "host_a",
                          "gpu_indices": list(indices), "gpu_type": "A100-80GB"}}


@pytest.fixture
def shell(monkeypatch: pytest.MonkeyPatch) -> Iterator[InteractiveShell]:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    ip = InteractiveShell.instance()
    gpu.load(ip)
    yield ip
    gpu.unload()
    ip.user_ns.pop("seen", None)


def run(ip: InteractiveShell, code: str, meta: dict[str, Any] | None = None) -> Any:
    """Run a cell as ipykernel does, with the request's metadata (IPython >= 9)."""
    return ip.run_cell(code, store_history=False, cell_meta=meta)


def test_a_bound_cell_sees_its_gpus_and_they_are_put_back(shell: InteractiveShell) -> None:
    assert gpu.current_binding() is None
    run(shell, "import os\nseen = {n: os.environ.get(n) for n in "
               "('CUDA_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER')}",
        bound(1, 3))
    assert shell.user_ns["seen"] == {"CUDA_VISIBLE_DEVICES": "1,3",
                                     "NVIDIA_VISIBLE_DEVICES": "1,3",
                                     "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    for name in NAMES:  # they were unset before: unset again
        assert name not in os.environ
    assert gpu.current_binding() is None


def test_previous_values_are_restored_even_when_the_cell_fails(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    result = run(shell, "import os\nseen = os.environ['CUDA_VISIBLE_DEVICES']\n1 / 0", bound(2))
    assert not result.success and shell.user_ns["seen"] == "2"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    assert os.environ["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "CUDA_DEVICE_ORDER" not in os.environ


def test_a_subprocess_of_the_cell_sees_the_binding(shell: InteractiveShell) -> None:
    run(shell, "import subprocess\n"
               "seen = subprocess.run(['sh', '-c', 'echo $CUDA_VISIBLE_DEVICES'],"
               " capture_output=True, text=True).stdout.strip()", bound(0, 5))
    assert shell.user_ns["seen"] == "0,5"


def test_no_gpus_means_none_visible(shell: InteractiveShell) -> None:
    run(shell, "import os\nseen = (os.environ['CUDA_VISIBLE_DEVICES'], "
               "os.environ['NVIDIA_VISIBLE_DEVICES'])", bound())
    assert shell.user_ns["seen"] == ("", "none")


def test_a_cell_without_a_binding_leaves_the_environment_alone(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    for meta in (None, {}, {"cellId": "abc"}):
        run(shell, "import os\nseen = os.environ.get('CUDA_VISIBLE_DEVICES')", meta)
        assert shell.user_ns["seen"] == "4"
    # A cell's own change to the variables, with no binding, is its own business.
    run(shell, "import os\nos.environ['CUDA_VISIBLE_DEVICES'] = '9'")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "9"


@pytest.mark.parametrize("raw", [
    "0,1", 3, [0], None,
    {"task_id": "t", "host_id": "h", "gpu_indices": "0,1"},
    {"task_id": "t", "host_id": "h", "gpu_indices": [True]},
    {"task_id": "t", "host_id": "h", "gpu_indices": ["1"]},
    {"task_id": "t", "host_id": "h", "gpu_indices": [1.0]},
    {"task_id": "t", "host_id": "h", "gpu_indices": [-1]},
    {"task_id": "t", "host_id": "h", "gpu_indices": [1, 1]},
    {"task_id": "t", "host_id": "h", "gpu_indices": list(range(100_000))},
    {"task_id": "t", "host_id": "h", "gpu_indices": [10**30]},
    {"task_id": 5, "host_id": "h", "gpu_indices": [0]},
    {"task_id": "", "host_id": "h", "gpu_indices": [0]},
    {"task_id": "t" * 201, "host_id": "h", "gpu_indices": [0]},
    {"host_id": "h", "gpu_indices": [0]},
    {"task_id": "t", "host_id": "h", "gpu_indices": [0], "gpu_type": ["x"]},
])
def test_a_malformed_binding_is_no_binding(shell: InteractiveShell, raw: object) -> None:
    result = run(shell, "import os\nseen = os.environ.get('CUDA_VISIBLE_DEVICES')",
                 {BINDING_KEY: raw})
    assert result.success and shell.user_ns["seen"] is None
    assert gpu.parse_binding(raw) is None
    # The agent judges a binding as the kernel does: neither tracks what the other ignores.
    assert agent_parse_binding(raw) is None


def test_kernel_and_agent_agree_on_a_good_binding() -> None:
    raw = bound(0, 2)[BINDING_KEY]
    agent = agent_parse_binding(raw)
    assert agent is not None
    assert dataclasses.asdict(gpu.parse_binding(raw)) == agent.model_dump()  # type: ignore[arg-type]
    assert gpu.BINDING_KEY == BINDING_KEY


def test_current_binding_is_read_only_and_only_during_the_cell(shell: InteractiveShell) -> None:
    run(shell, "from nbfleet.kernel import current_binding\nseen = current_binding()", bound(6))
    binding = shell.user_ns["seen"]
    assert binding == gpu.Binding("task_1", "host_a", (6,), "A100-80GB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        binding.gpu_indices = (0, 1, 2)
    assert gpu.current_binding() is None


def test_a_cell_run_by_a_cell_keeps_the_outer_binding(shell: InteractiveShell) -> None:
    run(shell, "get_ipython().run_cell('x = 1')\n"
               "import os\nseen = os.environ['CUDA_VISIBLE_DEVICES']", bound(3))
    assert shell.user_ns["seen"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_without_cell_meta_the_kernels_shell_parent_is_read(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Older IPython does not pass the request's metadata with the cell: ipykernel's
    ``get_parent("shell")`` (the whole request) is read instead."""
    kernel = types.SimpleNamespace(get_parent=lambda channel: {"metadata": bound(4)})
    monkeypatch.setattr(shell, "kernel", kernel, raising=False)
    run(shell, "import os\nseen = os.environ['CUDA_VISIBLE_DEVICES']")
    assert shell.user_ns["seen"] == "4"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


class FakeCuda:
    def __init__(self) -> None:
        self.initialized = False
        self.devices: list[int] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def set_device(self, ordinal: int) -> None:
        self.devices.append(ordinal)


def test_torch_that_cached_its_devices_is_pointed_at_the_bound_gpu(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    run(shell, "pass", bound(2, 3))
    assert cuda.devices == []  # not initialized: CUDA_VISIBLE_DEVICES is enough
    shell.user_ns["cuda"] = cuda
    run(shell, "cuda.initialized = True", bound(2, 3))  # CUDA now numbers GPUs 2, 3 as 0, 1
    run(shell, "pass", bound(3))
    assert cuda.devices == [1]
    run(shell, "pass", bound(5))  # not among those CUDA saw: the user is told
    assert cuda.devices == [1]
    assert "GPU 5 is not reachable" in capsys.readouterr().err
    shell.user_ns.pop("cuda")


def test_torch_is_never_imported_by_the_extension(shell: InteractiveShell) -> None:
    had = "torch" in sys.modules
    run(shell, "pass", bound(0))
    assert ("torch" in sys.modules) == had


def test_load_twice_installs_the_hooks_once(shell: InteractiveShell) -> None:
    gpu.load(shell)
    hooks = [h for h in shell.events.callbacks["pre_run_cell"]
             if getattr(h, "__self__", None).__class__ is gpu.GpuBinder]
    assert len(hooks) == 1


def test_the_kernel_extension_installs_the_binding_without_state_capture(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbfleet.kernel as extension

    monkeypatch.delenv("NBFLEET_STATE_DIR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ip = InteractiveShell.instance()
    extension.load_ipython_extension(ip)
    try:
        run(ip, "import os\nseen = os.environ['CUDA_VISIBLE_DEVICES']", bound(1))
        assert ip.user_ns.pop("seen") == "1"
    finally:
        extension.unload_ipython_extension(ip)
    run(ip, "import os\nseen = os.environ.get('CUDA_VISIBLE_DEVICES')", bound(1))
    assert ip.user_ns.pop("seen") is None  # unloaded: no hooks left behind
