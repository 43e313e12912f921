import time
from pathlib import Path
from tests.support.cluster import wait_until
from tests.support.job_api import funded_tenant, job_cluster, submit
from tests.integration.test_jobs_resilience import running, job_processes

def test_dbg(tmp_path: Path) -> None:
    with job_cluster(tmp_path, gpus="4xA100-80GB") as cluster:
        client = funded_tenant(cluster).client
        t = time.monotonic()
        ids = [submit(client, duration=3.0, max_attempts=1, args={"seed": i})["id"] for i in range(4)]
        print("submitted", time.monotonic() - t)
        def chk():
            s = time.monotonic()
            r = running(client, ids)
            print(" poll", len(r), time.monotonic() - s, time.monotonic() - t)
            return len(r) == 4
        wait_until(chk, 30, 0.1)
        print("running", time.monotonic() - t)
        wait_until(lambda: len(found := job_processes(ids, 1)) == 4 and found, 10, 0.1)
        print("procs", time.monotonic() - t)
