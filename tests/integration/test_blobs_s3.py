"""``--blobs s3://bucket/prefix`` for real: a control plane and two agents as real
processes on moto's S3-compatible HTTP server (tests/support/s3_server.py), with
credentials and endpoint in their environment only.

The blob store's contract on S3 is tests/unit/test_blobs.py (parametrized over a
directory and S3). Here: a workspace moves to another host through the bucket, job
results download from presigned URLs, kernels never see the credentials, and a
store that cannot be used stops ``nbfleet control`` (and an agent) with one line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse

import httpx
import pytest

from nbfleet.agent.job_process import job_env
from nbfleet.agent.slots import kernel_env
from nbfleet.jobs.results import sign, signing_key
from nbfleet.storage.blobs import BlobStore, BlobStoreUnusable
from tests.conftest import fresh_database
from tests.support.cluster import (
    NBFLEET,
    Cluster,
    agent_names,
    create_running,
    outcome,
    resume,
    run_cell,
    start_kernel,
    suspend,
)
from tests.support.job_api import (
    AGENT_ARGS,
    COMMAND,
    CONTROL_ARGS,
    funded_tenant,
    register,
    submit,
    wait_job,
)
from tests.support.s3_server import S3Server, s3_server

BUCKET = "nbfleet-e2e"
PREFIX = "fleet/blobs"
BLOBS = f"s3://{BUCKET}/{PREFIX}"

#: Without bubblewrap kernels run as the agent's user, outside a PID namespace, and
#: can read the agent's /proc/<pid>/environ (README says so of ``--sandbox none``).
HAS_BWRAP = shutil.which("bwrap") is not None
SANDBOX = ("--sandbox", "bwrap") if HAS_BWRAP else ()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def s3_cluster(tmp_path_factory: pytest.TempPathFactory, moto: S3Server) -> Iterator[Cluster]:
    """Control plane and two agents (own state directories) on one bucket; the
    jobs' fast timings and the fake video generator, for the result test."""
    root = tmp_path_factory.mktemp("s3cluster")
    with fresh_database(root) as url:
        cluster = Cluster(root, url)
        try:
            cluster.start_control(env=moto.env(), blobs=BLOBS, args=CONTROL_ARGS)
            for name in ("agent1", "agent2"):
                cluster.start_agent(name, env=moto.env(), args=(*AGENT_ARGS, *SANDBOX))
            register(cluster, "fakegen", "1.0", COMMAND)
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def result_job(s3_cluster: Cluster) -> tuple[httpx.Client, str]:
    """A tenant's client and a job of theirs that succeeded (its result: video.mp4)."""
    client = funded_tenant(s3_cluster).client
    done = wait_job(client, submit(client, args={"seed": 3})["id"])
    assert done["state"] == "succeeded", done
    return client, str(done["id"])


def _own_url(cluster: Cluster, job: str, expires: int) -> str:
    """A URL of nbfleet's own (the local store's kind) for the job's video.mp4."""
    return (f"{cluster.url}/v1/results/{job}/1/video.mp4?" + urlencode({
        "expires": expires,
        "signature": sign(signing_key(cluster.secret), job, 1, "video.mp4", expires)}))


def _amz_expires(url: str) -> int:
    return int(parse_qs(urlparse(url).query)["X-Amz-Expires"][0])


def test_job_results_are_in_the_bucket_and_download_from_presigned_urls(
        s3_cluster: Cluster, moto: S3Server, result_job: tuple[httpx.Client, str]) -> None:
    client, job = result_job
    assert "progress:" in client.get(f"/v1/jobs/{job}/logs").text  # log chunks, from S3
    assert f"{PREFIX}/jobs/{job}/1/output/video.mp4" in moto.keys(BUCKET, f"{PREFIX}/jobs/{job}/")

    (file,) = client.get(f"/v1/jobs/{job}/result").json()["files"]
    presigned = urlparse(file["url"])
    assert f"{presigned.scheme}://{presigned.netloc}" == moto.endpoint  # not the control plane
    # S3 checks the signature (moto does not: it proves the URL's form and target).
    assert "X-Amz-Signature=" in presigned.query and "X-Amz-Expires=" in presigned.query
    response = httpx.get(file["url"])  # no token: the URL is the permission
    data = response.content
    assert len(data) == file["size"] > 0
    assert hashlib.sha256(data).hexdigest() == file["sha256"]
    # A download, never a page of the endpoint's origin (tests/unit/test_blobs.py).
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["content-disposition"] == 'attachment; filename="video.mp4"'

    # A URL of nbfleet's own (the local store's kind) redirects to a presigned one.
    own = _own_url(s3_cluster, job, int(time.time()) + 60)
    redirect = httpx.get(own)
    assert redirect.status_code == 307
    assert redirect.headers["location"].startswith(f"{moto.endpoint}/{BUCKET}/{PREFIX}/jobs/")
    assert httpx.get(own, follow_redirects=True).content == data
    assert httpx.get(own.replace("signature=", "signature=0")).status_code == 403


def test_presigned_urls_expire_no_later_than_nbfleets_own(
        s3_cluster: Cluster, result_job: tuple[httpx.Client, str]) -> None:
    """The time left, rounded down: a presigned URL never outlives the one it stands for."""
    client, job = result_job
    before = time.time()
    body = client.get(f"/v1/jobs/{job}/result").json()
    (file,) = body["files"]
    assert body["url_expires_at"] - before - 2 <= _amz_expires(file["url"])
    assert _amz_expires(file["url"]) <= body["url_expires_at"] - before

    expires = int(time.time()) + 60
    before = time.time()
    redirect = httpx.get(_own_url(s3_cluster, job, expires))
    assert redirect.status_code == 307, redirect.text
    assert expires - before - 2 <= _amz_expires(redirect.headers["location"]) <= expires - before


def test_the_redirect_is_a_404_once_the_file_is_gone(
        s3_cluster: Cluster, moto: S3Server, result_job: tuple[httpx.Client, str]) -> None:
    """Deleted behind nbfleet's back (a lifecycle rule, an operator): no redirect to
    a URL that can only fail. Deletes the result: runs after the tests above."""
    _, job = result_job
    moto.client().delete_object(Bucket=BUCKET, Key=f"{PREFIX}/jobs/{job}/1/output/video.mp4")
    response = httpx.get(_own_url(s3_cluster, job, int(time.time()) + 60))
    assert response.status_code == 404, response.text
    assert "location" not in response.headers


@pytest.mark.skipif(not HAS_BWRAP, reason="without bubblewrap kernels run as the agent's "
                    "user and can read its /proc/<pid>/environ (--sandbox none)")
def test_kernels_never_see_the_agents_aws_credentials(s3_cluster: Cluster,
                                                      moto: S3Server) -> None:
    """The agents hold AWS_SECRET_ACCESS_KEY (they write the bucket); user code must
    find it neither in its environment nor in any process's it can read: bwrap's
    PID namespace leaves only the sandbox's own processes in /proc."""
    client = s3_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    cell = ("import glob, os\n"
            f"secret = {moto.secret_key!r}.encode()\n"
            "def holds(path):\n"
            "    try:\n"
            "        return secret in open(path, 'rb').read()\n"
            "    except OSError:\n"
            "        return False\n"
            "print(sorted(k for k in os.environ if k.startswith('AWS')),"
            " any(secret in v.encode() for v in os.environ.values()),"
            " [p for p in glob.glob('/proc/[0-9]*/environ') if holds(p)])")
    assert outcome(run_cell(s3_cluster, client, ws, kernel, cell)) == "[] False []\n"


def test_kernel_and_job_environments_are_built_without_aws_variables(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The functions that build them, with every AWS_* variable an agent may have."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.setenv(name, "agent-only")
    for env in (kernel_env(str(tmp_path)),
                job_env(str(tmp_path), str(tmp_path / "out"), "job_x", 1, [0])):
        assert not [name for name in env if name.startswith("AWS")]
        assert "agent-only" not in env.values()


def test_a_workspace_moves_to_another_host_through_the_bucket(
        s3_cluster: Cluster, moto: S3Server) -> None:
    """Suspend, lose the host (kill -9), resume: the other agent rebuilds the
    workspace, files and variables, from S3 alone. Kills an agent: runs after the
    tests that need both."""
    client = s3_cluster.new_user()
    ws = create_running(client)
    assert client.put(f"/v1/workspaces/{ws}/files/uploaded.txt",
                      content=b"via the API").status_code in (200, 201)
    kernel = start_kernel(client, ws)
    cell = "answer = 6 * 7\nopen('made.txt', 'w').write('by the kernel')\nprint('ok')"
    assert outcome(run_cell(s3_cluster, client, ws, kernel, cell)) == "ok\n"
    first = client.get(f"/v1/workspaces/{ws}").json()["host_id"]
    names = agent_names(s3_cluster)
    assert first in names

    suspend(client, ws)
    keys = moto.keys(BUCKET, f"{PREFIX}/workspaces/{ws}/")
    assert {f"{PREFIX}/workspaces/{ws}/files/uploaded.txt",
            f"{PREFIX}/workspaces/{ws}/files/made.txt"} <= set(keys)
    assert any(key.startswith(f"{PREFIX}/workspaces/{ws}/snapshots/") for key in keys), keys

    s3_cluster.kill_agent(names[first])  # the host and its disk are gone
    body = resume(client, ws)
    assert body["host_id"] != first and body["host_id"] in names
    check = "print(answer, open('made.txt').read(), open('uploaded.txt').read())"
    assert outcome(run_cell(s3_cluster, client, ws, kernel, check)) == (
        "42 by the kernel via the API\n")
    assert not (s3_cluster.home / "blobs").exists()  # the control plane wrote no blob locally


def test_an_agent_that_cannot_use_the_bucket_stops_with_one_line(
        s3_cluster: Cluster, moto: S3Server) -> None:
    """It learns the URL when it registers, and checks it then, as the control plane
    does at its start. Leaves a dead host registered: runs last of the cluster's."""
    env = {name: value for name, value in moto.env().items()
           if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    proc = s3_cluster._spawn("agent-nocreds", [
        "agent", "--control", s3_cluster.url, "--state-dir", str(s3_cluster.root / "nocreds"),
        "--secret-file", str(s3_cluster.secret_file), "--gpus", "1xA100-80GB",
        "--warm-pool", "0", "--workspace-disk", "0", *SANDBOX], s3_cluster._env(env))
    try:
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (s3_cluster.logs / "agent-nocreds.log").read_text()
    assert ("cannot use the blob store the control plane named: "
            f"{BLOBS}: no credentials: set AWS_ACCESS_KEY_ID") in log, log


# ----------------------------------------------------------------- a store that can't work
def _control(home: Path, blobs: str, env: dict[str, str],
             *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("NBFLEET_", "AWS_"))}
    return subprocess.run([*NBFLEET, "control", "--home", str(home), "--port", "0",
                           "--blobs", blobs, *args], env={**base, **env},
                          capture_output=True, text=True, timeout=120, cwd=home.parent)


def _refused(result: subprocess.CompletedProcess[str], reason: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "error: --blobs:" in result.stderr and reason in result.stderr, result.stderr


def test_a_missing_bucket_stops_the_control_plane_with_one_line(
        moto: S3Server, tmp_path: Path) -> None:
    """At ``--log-level debug`` too, which must not print botocore's requests: their
    headers carry the signature (and X-Amz-Security-Token with a session)."""
    result = _control(tmp_path / "home", "s3://nonexistent-bucket/x", moto.env(),
                      "--log-level", "debug")
    _refused(result, "no such bucket: nonexistent-bucket")
    for leak in ("AWS4-HMAC-SHA256", "Authorization", moto.access_key):
        assert leak not in result.stderr + result.stdout, result.stderr


def test_a_blobs_url_that_is_neither_a_directory_nor_s3_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``s3:/bucket/x`` made ``./s3:/bucket/x``; fsspec's other schemes (memory://,
    http://) were accepted too. Only a path or s3://bucket[/prefix]."""
    for url in ("s3:/bucket/x", "memory://blobs", "http://example.com/blobs"):
        _refused(_control(tmp_path / "home", url, {}), f"cannot use {url}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no ./s3:
    for url in ("file:///tmp/x", "s3://", "s3://b", "s3://bucket/a//b", "s3://bucket/../x",
                "s3://bucket/x?versionId=1", "gs://bucket/x", ""):
        with pytest.raises(ValueError, match="s3://bucket"):
            BlobStore(url)
    monkeypatch.chdir(tmp_path)
    for url in ("relative/blobs", "./s3:/x", str(tmp_path / "absolute")):
        assert BlobStore(url).local
    assert BlobStore("s3a://bucket/x").s3 and BlobStore("s3://bucket").s3


def test_missing_credentials_are_named(moto: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``nbfleet control`` prints for a store that fails its check (the
    command's path is the test above)."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in moto.env().items():
        if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(name, value)
    with pytest.raises(BlobStoreUnusable, match="no credentials: set AWS_ACCESS_KEY_ID"):
        BlobStore(BLOBS).check()


def test_wrong_credentials_stop_the_control_plane_with_one_line(tmp_path: Path) -> None:
    """moto checking signatures as AWS does: a key it never issued is refused."""
    with s3_server(tmp_path, authenticate=True) as server:
        result = _control(tmp_path / "home", BLOBS, server.env())
    _refused(result, f"access to bucket {BUCKET} was refused: check the credentials")
    assert server.secret_key not in result.stderr + result.stdout
