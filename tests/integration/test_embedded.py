"""`nbfleet up`: one command, Ctrl-C stops it cleanly, a restart keeps everything."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
from pathlib import Path

import httpx
import nbformat

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.support.cluster import NBFLEET, free_port, wait_state, wait_until


class Embedded:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
        env["NBFLEET_HOME"] = str(self.home)
        log = open(self.home.parent / "up.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([*NBFLEET, "up", "--port", str(self.port), "--gpus",
                                      "2xA100-80GB"], env=env, stdout=log, stderr=log)

        def ready() -> bool:
            token_file = self.home / "admin-token"
            if not token_file.exists():
                return False
            agents = self.admin().get("/v1/admin/agents").json()["items"]
            return len(agents) == 1

        wait_until(ready, 60, what="nbfleet up")

    def admin(self) -> httpx.Client:
        token = (self.home / "admin-token").read_text().strip()
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                            timeout=30)

    def interrupt(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(30)
        self.proc = None
        return code


PRIVATE_FILES = ("nbfleet.db", "nbfleet.db-wal", "nbfleet.db-shm", "admin-token",
                 "cluster-secret", "url")


def modes(home: Path) -> dict[str, int]:
    """The modes of the home and of what embedded mode keeps in it."""
    return {name: stat.S_IMODE(os.stat(home / name).st_mode)
            for name in (".", "blobs", "agent", *PRIVATE_FILES)}


PRIVATE = {".": 0o700, "blobs": 0o700, "agent": 0o700, **dict.fromkeys(PRIVATE_FILES, 0o600)}


def test_up_restart_keeps_workspaces_and_files(tmp_path: Path) -> None:
    platform = Embedded(tmp_path / "home")
    platform.start()
    try:
        assert modes(platform.home) == PRIVATE  # SQLite's -wal and -shm included
        assert httpx.get(f"{platform.url}/metrics").status_code == 401
        admin = platform.admin()
        agents = admin.get("/v1/admin/agents").json()["items"]
        assert agents[0]["inventory"]["gpus"] == [{"count": 2, "type": "A100-80GB", "vram_gb": 80}]
        ws = admin.post("/v1/workspaces", json={"name": "persist"}).json()["id"]
        wait_state(admin, ws, "running")
        notebook = nbformat.writes(nbformat.v4.new_notebook()).encode()
        admin.put(f"/v1/workspaces/{ws}/files/demo.ipynb", content=notebook)
        kernel = admin.post(f"/v1/workspaces/{ws}/api/kernels", json={}).json()["id"]
        token = admin.headers["Authorization"].split()[1]
        url = (f"ws://127.0.0.1:{platform.port}/v1/workspaces/{ws}"
               f"/api/kernels/{kernel}/channels")

        async def write_from_kernel() -> str:
            sock = await KernelSocket.connect(url, token)
            try:
                code = "open('from-kernel.txt', 'w').write('written by user code')"
                return (await sock.execute(code)).status
            finally:
                await sock.close()

        assert asyncio.run(write_from_kernel()) == "ok"
        admin.post(f"/v1/workspaces/{ws}/suspend")
        wait_state(admin, ws, "suspended")
        admin.post(f"/v1/workspaces/{ws}/resume")
        wait_state(admin, ws, "running")

        assert platform.interrupt() == 0  # Ctrl-C: a clean exit
        for name in (".", "blobs", "nbfleet.db", "admin-token", "cluster-secret"):
            os.chmod(platform.home / name, 0o755 if name in (".", "blobs") else 0o644)
        platform.start()  # same home: same DB, blobs and admin token
        assert modes(platform.home) == PRIVATE  # what an older version left, tightened
        admin = platform.admin()
        body = wait_state(admin, ws, "running")
        assert body["name"] == "persist"
        files = {f["path"] for f in admin.get(f"/v1/workspaces/{ws}/files").json()["files"]}
        assert files == {"demo.ipynb", "from-kernel.txt"}
        assert admin.get(f"/v1/workspaces/{ws}/files/demo.ipynb").content == notebook
        # The restart re-placed the workspace on the agent's new boot, with its kernel.
        kernels = admin.get(f"/v1/workspaces/{ws}/api/kernels").json()
        assert [k["id"] for k in kernels] == [kernel]
    finally:
        if platform.proc is not None:
            platform.interrupt()


def test_up_rejects_a_bad_gpu_spec(tmp_path: Path) -> None:
    env = {**os.environ, "NBFLEET_HOME": str(tmp_path)}
    result = subprocess.run([*NBFLEET, "up", "--gpus", "lots-of-gpus"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid GPU spec 'lots-of-gpus'" in result.stderr
