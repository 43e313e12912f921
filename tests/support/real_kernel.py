"""A real ipykernel started the way the agent starts one (``--ext nbfleet.kernel``,
``NBFLEET_STATE_DIR``), driven by a blocking jupyter_client, and the copy of a
snapshot the agent makes between a suspend and a resume."""

from __future__ import annotations

import ast
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from jupyter_client.manager import KernelManager

FLUSH = "__import__('nbfleet.kernel').kernel.flush()"
RESTORE = "__import__('nbfleet.kernel').kernel.restore()"


class Kernel:
    """A real kernel started the way the agent starts one, driven by a blocking client."""

    def __init__(self, state_dir: Path, workdir: Path, preimport: str = "") -> None:
        self.state_dir = state_dir
        self.manager = KernelManager(kernel_name="python3")
        env = {**os.environ, "NBFLEET_STATE_DIR": str(state_dir), "NBFLEET_PREIMPORT": preimport}
        self.manager.start_kernel(extra_arguments=["--ext", "nbfleet.kernel"], env=env,
                                  cwd=str(workdir))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def execute(
        self, code: str, *, silent: bool = False, user_expressions: dict[str, str] | None = None
    ) -> tuple[dict[str, Any], str, float]:
        """(execute_reply content, stdout+errors, seconds until the reply arrived)."""
        started = time.perf_counter()
        msg_id = self.client.execute(code, silent=silent, store_history=not silent,
                                     user_expressions=user_expressions or {})
        reply = self.client.get_shell_msg(timeout=60)
        while reply["parent_header"]["msg_id"] != msg_id:
            # wait_for_ready() may leave a second kernel_info_reply behind under load
            assert reply["msg_type"] == "kernel_info_reply", reply
            reply = self.client.get_shell_msg(timeout=60)
        elapsed = time.perf_counter() - started
        out = []
        while True:
            msg = self.client.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        return reply["content"], "".join(out), elapsed

    def cell(self, code: str) -> str:
        reply, out, _ = self.execute(code)
        assert reply["status"] == "ok", out
        return out

    def value(self, expression: str) -> Any:
        """Evaluate a JSON-able expression without running a cell (no capture hooks)."""
        reply, _, _ = self.execute(
            "", silent=True, user_expressions={"v": f"__import__('json').dumps({expression})"})
        result = reply["user_expressions"]["v"]
        assert result["status"] == "ok", result
        return json.loads(ast.literal_eval(result["data"]["text/plain"]))

    def call(self, api: str) -> dict[str, Any]:
        """Call flush()/restore() as the agent does: a silent execute request."""
        reply, out, _ = self.execute(f"__nbfleet_result = {api}", silent=True)
        assert reply["status"] == "ok", out
        result: dict[str, Any] = self.value("__nbfleet_result")
        return result

    def stop(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def copy_snapshot(source: Path, target: Path) -> None:
    """What the agent does between suspend and resume."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "manifest.json", target / "manifest.json")
    if (source / "blobs").is_dir():
        shutil.copytree(source / "blobs", target / "blobs")


