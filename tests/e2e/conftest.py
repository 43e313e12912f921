"""E2E helpers: a real ``jupyter server`` pointed at an nbfleet workspace, and logs
that show up in the report of a failing test (these tests span several processes,
and a bare assertion rarely says which one misbehaved)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import free_port, wait_until

#: Log files whose tails are attached to the report when the test fails.
LOGS = pytest.StashKey[list[Path]]()
LOG_TAIL_CHARS = 20_000


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for path in item.stash.get(LOGS, []):
            text = path.read_text(errors="replace") if path.exists() else "(no log written)"
            report.sections.append((f"log {path.name}", text[-LOG_TAIL_CHARS:]))
    return report


def attach_log(request: pytest.FixtureRequest, path: Path) -> None:
    """Have ``path`` printed in the report if this test fails."""
    request.node.stash.setdefault(LOGS, []).append(path)


@dataclass(frozen=True)
class JupyterServer:
    url: str
    token: str
    log: Path

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60.0,
                                 headers={"Authorization": f"token {self.token}"})


def _isolated_env(root: Path) -> dict[str, str]:
    """No user or ambient Jupyter config may leak in (e.g. a JUPYTER_GATEWAY_* var)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER_", "NBFLEET_", "IPYTHON"))}
    for name in ("runtime", "data", "config"):
        (root / name).mkdir(parents=True, exist_ok=True)
    env.update(JUPYTER_RUNTIME_DIR=str(root / "runtime"), JUPYTER_DATA_DIR=str(root / "data"),
               JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_PLATFORM_DIRS="1",
               HOME=str(root), PYTHONUNBUFFERED="1")
    return env


@contextmanager
def jupyter_server(root: Path, gateway_url: str, gateway_token: str) -> Iterator[JupyterServer]:
    """Run ``jupyter server --gateway-url=...`` until the block ends (killed even on error)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "notebooks").mkdir(exist_ok=True)
    port, token, log = free_port(), secrets.token_hex(16), root / "jupyter-server.log"
    args = [
        sys.executable, "-m", "jupyter_server",
        f"--gateway-url={gateway_url}",
        "--GatewayClient.auth_scheme=token",
        "--GatewayClient.request_timeout=60",
        "--ServerApp.ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        "--no-browser",
        f"--ServerApp.root_dir={root / 'notebooks'}",
        "--ServerApp.allow_root=True",
        "--debug",
    ]
    # Tokens go in the environment, never on the command line (/proc/PID/cmdline is
    # readable by every local user).
    env = {**_isolated_env(root), "JUPYTER_TOKEN": token,
           "JUPYTER_GATEWAY_AUTH_TOKEN": gateway_token}
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = JupyterServer(f"http://127.0.0.1:{port}", token, log)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited with {proc.returncode}; see {log}")
            response = httpx.get(f"{server.url}/api/status",
                                 headers={"Authorization": f"token {token}"})
            return response.status_code == 200

        wait_until(up, 60, 0.2, "jupyter server /api/status")
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
