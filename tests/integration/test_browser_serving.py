"""What only a real ``nbfleet control`` shows about the browser's protections:
uvicorn's own logs (its access log at ``--log-level debug``, its WebSocket lines
at info) never carry a token or a channel ticket from a URL, and behind a TLS
proxy the session cookies are ``Secure``: from ``X-Forwarded-Proto`` sent by a
proxy uvicorn trusts (loopback), or whatever the request says with
``--secure-cookies always``. No agent runs: nothing here needs a kernel.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from tests.conftest import fresh_database
from tests.support.cluster import NBFLEET, Cluster, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.db_agnostic]


def control_only(root: Path, *args: str) -> Iterator[Cluster]:
    with fresh_database(root) as url:
        cluster = Cluster(root, url)
        try:
            cluster.start_control(args=args)
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def debug_control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane logging everything uvicorn logs: the access log is on."""
    yield from control_only(tmp_path_factory.mktemp("debug"), "--log-level", "debug")


def user(cluster: Cluster) -> tuple[str, str]:
    """A new user's token and a workspace of theirs (it waits for a host forever)."""
    client = cluster.new_user(name=f"u{uuid.uuid4().hex[:8]}")
    created = client.post("/v1/workspaces", json={"name": "logs"})
    assert created.status_code in (201, 202), created.text
    return client.headers["Authorization"].split()[1], created.json()["id"]


def log_text(cluster: Cluster) -> str:
    return (cluster.logs / "control.log").read_text(errors="replace")


def test_tokens_and_tickets_in_urls_never_reach_the_logs(debug_control: Cluster) -> None:
    cluster = debug_control
    token, workspace_id = user(cluster)
    owner = cluster.client(token)
    ticket = owner.post(f"/v1/workspaces/{workspace_id}/channel-tickets").json()["ticket"]
    anonymous = httpx.Client(base_url=cluster.url)
    # Refused over HTTP (401), accepted by Lab's page (a sign-in) and by a WebSocket.
    assert anonymous.get("/v1/workspaces", params={"token": token}).status_code == 401
    signed = anonymous.get(f"/w/{workspace_id}/lab", params={"token": token})
    assert signed.status_code == 303
    session = signed.cookies["nbfleet_session"]
    assert anonymous.get(f"/w/{workspace_id}/api/contents",
                         params={"_xsrf": "x" * 64, "token": token}).status_code == 401
    ws = f"ws://127.0.0.1:{cluster.port}"

    async def sockets() -> None:
        async with websockets.connect(
                f"{ws}/w/{workspace_id}/api/events/subscribe?token={token}"):
            pass
        # Headers: at debug level the websockets library logs each one it receives.
        async with websockets.connect(
                f"{ws}/w/{workspace_id}/api/events/subscribe",
                additional_headers={"Authorization": f"Bearer {token}"}):
            pass
        async with websockets.connect(f"{ws}/w/{workspace_id}/api/events/subscribe",
                                      additional_headers={"Cookie":
                                                          f"nbfleet_session={session}"}):
            pass
        with pytest.raises(websockets.InvalidStatus):  # no such kernel: refused, and logged
            async with websockets.connect(
                    f"{ws}/t/{ticket}/w/{workspace_id}/api/kernels/nope/channels"):
                pass

    asyncio.run(sockets())
    wait_until(lambda: "/t/[redacted]/w/" in log_text(cluster), 30,
               what="the ticket's WebSocket line in the log")
    wait_until(lambda: log_text(cluster).count("token=[redacted]") >= 4, 30,
               what="the requests' lines in the log")
    text = log_text(cluster)
    assert token not in text and ticket not in text and session not in text
    assert "< authorization: [redacted]" in text and "< cookie: [redacted]" in text
    assert token.removeprefix("nbf_")[:12] not in text  # not even a piece of it
    assert '"GET /v1/workspaces?token=[redacted] HTTP/1.1" 401' in text  # the access log
    assert f"WebSocket /w/{workspace_id}/api/events/subscribe?token=[redacted]" in text
    assert "_xsrf=[redacted]" in text


def session_cookie(response: httpx.Response) -> str:
    return next(c for c in response.headers.get_list("set-cookie")
                if c.startswith("nbfleet_session="))


def test_behind_a_trusted_tls_proxy_cookies_are_secure(debug_control: Cluster) -> None:
    """``--secure-cookies auto``: uvicorn believes X-Forwarded-Proto from loopback."""
    token, workspace_id = user(debug_control)
    anonymous = httpx.Client(base_url=debug_control.url)
    lab = f"/w/{workspace_id}/lab"
    proxied = anonymous.get(lab, params={"token": token},
                            headers={"X-Forwarded-Proto": "https"})
    assert proxied.status_code == 303
    assert "; secure" in session_cookie(proxied).lower()
    plain = anonymous.get(lab, params={"token": token})
    assert "; secure" not in session_cookie(plain).lower()


def test_with_secure_cookies_always_they_are_secure_over_plain_http(tmp_path: Path) -> None:
    """A TLS proxy uvicorn does not trust (not on loopback), or one that sends no
    X-Forwarded-Proto: the request looks like plain http."""
    for cluster in control_only(tmp_path, "--secure-cookies", "always"):
        token, workspace_id = user(cluster)
        answer = httpx.get(f"{cluster.url}/w/{workspace_id}/lab", params={"token": token})
        assert answer.status_code == 303
        cookies = answer.headers.get_list("set-cookie")
        assert len(cookies) == 2 and all("; secure" in c.lower() for c in cookies)


def test_an_unknown_secure_cookies_value_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([*NBFLEET, "control", "--home", str(tmp_path), "--secure-cookies",
                           "sometimes"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--secure-cookies" in done.stderr and "auto, always" in done.stderr
