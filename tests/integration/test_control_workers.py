"""``nbfleet control --workers N``: N control-plane processes on one port, each a
replica (its own loop, pool and job intake); one that dies is replaced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import wait_until
from tests.support.credit_api import verified
from tests.support.job_api import funded_tenant, job_cluster, submit, wait_all


def children(parent: int) -> set[int]:
    """The processes ``parent`` forked from its main thread (the workers)."""
    try:
        return {int(pid) for pid in
                Path(f"/proc/{parent}/task/{parent}/children").read_text().split()}
    except FileNotFoundError:  # the parent has exited
        return set()


@pytest.mark.skipif(not os.environ.get("NBFLEET_TEST_PG"),
                    reason="--workers needs PostgreSQL (CI's second pass runs it)")
def test_workers_share_the_port_and_one_killed_is_replaced(tmp_path: Path) -> None:
    with job_cluster(tmp_path, control_args=("--workers", "2")) as cluster:
        assert cluster.control is not None
        parent = cluster.control.pid
        wait_until(lambda: len(children(parent)) == 2, 30, what="two workers")
        tenant = funded_tenant(cluster)
        token = tenant.client.headers["authorization"]

        def one(_: int) -> str:
            with httpx.Client(base_url=cluster.url, headers={"Authorization": token},
                              timeout=60) as client:  # a connection each: both workers serve
                return str(submit(client, duration=0.05)["id"])

        with ThreadPoolExecutor(16) as pool:
            before = list(pool.map(one, range(16)))
        victim = min(children(parent))
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: victim not in children(parent) and len(children(parent)) == 2, 30,
                   what="a replacement worker")
        with ThreadPoolExecutor(16) as pool:
            after = list(pool.map(one, range(16)))
        ended = wait_all(tenant.client, before + after)
        assert {job["state"] for job in ended.values()} == {"succeeded"}
        verified(cluster)
        cluster.control.send_signal(signal.SIGTERM)  # stops the workers with it
        cluster.control.wait(30)
        assert children(parent) == set()
        cluster.control = None


@pytest.mark.no_db
def test_workers_need_postgresql(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "nbfleet.cli.main", "control", "--workers", "2",
                           "--home", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "needs PostgreSQL" in done.stdout + done.stderr
    assert not (tmp_path / "nbfleet.db").exists()  # refused before touching anything
