"""A kernel's capture and restore, in this process, on a real IPython shell.

``Session`` runs cells the way ipykernel does (history stored, so ``Out`` and the
counter move), lets the capture worker finish between cells when asked (a
person's pause), flushes as a suspend does, and resumes into an emptied shell
with a new capture, as a fresh kernel would start. Process-wide settings (the
environment, ``sys.path``, the directory, RNGs, matplotlib) cannot be emptied
for real in one process: a test resets what it checks through ``fresh``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from nbfleet.kernel import snapshot
from nbfleet.kernel.capture import Capture
from nbfleet.kernel.restore import restore as restore_state


def shell() -> InteractiveShell:
    config = Config()
    config.HistoryManager.enabled = False  # In and Out still kept; no SQLite
    ip: InteractiveShell = InteractiveShell.instance(config=config)
    ip.history_manager.enabled = False  # if another test made the instance first
    return ip


class Session:
    def __init__(self, ip: InteractiveShell, state_dir: Path) -> None:
        self.shell = ip
        self.state_dir = state_dir
        self._empty()
        self.capture = Capture(ip, state_dir)
        self.capture.start()

    @property
    def ns(self) -> dict[str, Any]:
        namespace: dict[str, Any] = self.shell.user_ns
        return namespace

    def cell(self, code: str, pause: bool = True) -> Any:
        """Run a cell that must succeed; ``pause``: then wait for the capture worker."""
        result = self.shell.run_cell(code, store_history=True)
        error = result.error_before_exec or result.error_in_exec
        if error is not None:
            raise AssertionError(f"cell failed: {code!r}") from error
        if pause:
            self.capture.idle()
        return result.result

    def suspend(self) -> dict[str, Any]:
        summary: dict[str, Any] = snapshot.flush(self.capture)
        return summary

    def resume(self, fresh: Callable[[], None] | None = None) -> dict[str, Any]:
        """Empty the shell as a new kernel is, run ``fresh``, start a capture, restore."""
        self.capture.stop()
        self._empty()
        if fresh is not None:
            fresh()
        self.capture = Capture(self.shell, self.state_dir)
        self.capture.start()
        report: dict[str, Any] = restore_state(self.shell, self.state_dir, self.capture, 5.0)
        return report

    def close(self) -> None:
        self.capture.stop()
        self._empty()

    def _empty(self) -> None:
        self.shell.reset(new_session=False)
        history = self.shell.history_manager
        history.input_hist_parsed[:] = [""]
        history.input_hist_raw[:] = [""]
        self.shell.execution_count = 1
