"""A real S3-compatible HTTP server for tests: moto's standalone server.

It runs in its own process on a free loopback port, so the blob store talks to it
exactly as to S3 (botocore, signed HTTP requests, the same error codes) and every
nbfleet process of a cluster can reach it. docs/decisions.md says why moto rather
than MinIO or an in-process mock.

Everything nbfleet needs to find it is in :meth:`S3Server.env`, the standard AWS
variables, as an operator would give them: no option carries a credential.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from tests.support.cluster import free_port, wait_until

REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    access_key: str = "nbfleet-test"
    #: Random per server: a test can look for it where it must never be.
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    #: moto's record of every request it served, when started with ``record``.
    recording: Path | None = None

    def env(self) -> dict[str, str]:
        """The variables botocore reads, and nothing from this machine's own AWS
        configuration (no ~/.aws, no instance metadata)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def reached_at(self, address: str) -> S3Server:
        """The same server, at another of its addresses (a host's gateway)."""
        port = self.endpoint.rsplit(":", 1)[1]
        return replace(self, endpoint=f"http://{address}:{port}")

    def client(self) -> Any:
        """A boto3 client of its own, to look at the bucket behind nbfleet's back."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    @contextlib.contextmanager
    def requests(self) -> Iterator[list[tuple[str, str]]]:
        """The requests moto serves while the block runs, as (method, raw URL),
        filled in when it ends (a server started with ``record``)."""
        assert self.recording is not None, "start the server with record=True"
        start = self.recording.stat().st_size if self.recording.exists() else 0
        seen: list[tuple[str, str]] = []
        yield seen
        with open(self.recording, "rb") as handle:
            handle.seek(start)
            for line in handle:
                entry = json.loads(line)
                seen.append((entry["method"], entry["url"]))


@contextlib.contextmanager
def s3_server(log_dir: Path, authenticate: bool = False,
              record: bool = False, listen: str = "127.0.0.1") -> Iterator[S3Server]:
    """moto's server until the block ends. ``authenticate``: requests must be
    signed by a key moto knows (an IAM user's), as AWS checks them; by default
    moto accepts any key. ``record``: moto writes down every request (with its
    body: for small tests), for :meth:`S3Server.requests`. ``listen``: the address
    it listens on (``0.0.0.0`` for hosts in network namespaces; its endpoint
    stays the loopback one: :meth:`S3Server.reached_at` gives another)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if authenticate:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    recording = log_dir / f"moto-{port}.requests" if record else None
    if recording is not None:
        env.update(MOTO_ENABLE_RECORDING="true", MOTO_RECORDER_FILEPATH=str(recording))
    log = open(log_dir / f"moto-{port}.log", "ab")  # noqa: SIM115 (lives with the process)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", listen,
                             "-p", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{port}", recording=recording)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"moto's server exited with {proc.returncode}: see {log.name}")
        return httpx.get(f"{server.endpoint}/moto-api/").status_code == 200

    try:
        wait_until(ready, 60, what="moto server")
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@contextlib.contextmanager
def aws_env(server: S3Server) -> Iterator[None]:
    """This process's environment pointed at ``server`` (for a BlobStore built
    here, and for processes a Cluster starts), restored afterwards."""
    with_vars = server.env()
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for name in saved:
        del os.environ[name]
    os.environ.update(with_vars)
    try:
        yield
    finally:
        for name in with_vars:
            os.environ.pop(name, None)
        os.environ.update(saved)
