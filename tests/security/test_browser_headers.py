"""What the browser is told, attacked: JupyterLab framed by another site or talking
to one, the dashboard framed, session cookies without ``Secure`` behind TLS, and
API tokens carried in URLs (which end up in proxies' logs and browser history).

The control plane runs in-process, as in ``test_web_sessions``; what only a real
server shows (uvicorn's logs, ``X-Forwarded-Proto``) is in
``tests/integration/test_browser_serving.py``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from nbfleet.control.app import create_app
from nbfleet.control.platform import ControlConfig
from tests.security.test_web_sessions import Site, sign_in


@pytest.fixture
def site(db_url: str, tmp_path: Path) -> Iterator[Site]:
    config = ControlConfig(db_url=db_url, blobs_url=str(tmp_path / "blobs"),
                           secret=secrets.token_urlsafe(32))
    app = create_app(config, run_reconciler=False)
    with TestClient(app):
        yield Site(app)
    app.state.platform.db.dispose()


def policy(response: Response) -> dict[str, list[str]]:
    """A Content-Security-Policy header as directive -> sources."""
    header = response.headers.get("content-security-policy", "")
    directives = [part.split() for part in header.split(";") if part.strip()]
    return {words[0]: words[1:] for words in directives}


def open_lab(site: Site, workspace_id: str, base_url: str = "http://testserver"
             ) -> tuple[TestClient, Response]:
    """Jupyter's token login: the sign-in answer (its cookies) and a browser holding them."""
    browser = site.browser(base_url)
    signed = browser.get(f"/w/{workspace_id}/lab", params={"token": site.token(site.alice)})
    assert signed.status_code == 303, signed.text
    return browser, signed


# ------------------------------------------------------------------ JupyterLab
def test_lab_cannot_be_framed_by_another_site_nor_talk_to_one(site: Site) -> None:
    workspace_id = site.workspace(site.alice)  # suspended: the page carries the banner too
    browser, _ = open_lab(site, workspace_id)
    page = browser.get(f"/w/{workspace_id}/lab")
    assert page.status_code == 200 and "nbfleet-banner" in page.text
    csp = policy(page)
    assert csp["frame-ancestors"] == ["'self'"]
    assert page.headers["x-frame-options"] == "SAMEORIGIN"
    # Where a cell's script could send what it reads: this server only.
    for directive in ("connect-src", "form-action", "base-uri", "default-src", "script-src",
                      "style-src", "font-src", "frame-src", "worker-src", "media-src"):
        foreign = [source for source in csp[directive]
                   if source not in ("'self'", "'unsafe-inline'", "'unsafe-eval'", "data:",
                                     "blob:")]
        assert foreign == [], (directive, foreign)
    assert csp["connect-src"] == ["'self'"] and csp["form-action"] == ["'self'"]
    assert csp["base-uri"] == ["'self'"] and csp["object-src"] == ["'none'"]
    assert csp["img-src"] == ["'self'", "data:", "blob:", "https:"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "same-origin"
    assert page.headers["cache-control"] == "no-store"
    # What the page loads is all this server's, so 'self' is all it needs.
    sources = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert sources and all(s.startswith("/") and not s.startswith("//") for s in sources)
    script = next(s for s in sources if s.endswith(".js") or ".js?" in s)
    asset = browser.get(script)
    assert asset.status_code == 200 and asset.headers["content-type"].startswith(
        "text/javascript")
    assert asset.headers["x-content-type-options"] == "nosniff"


def test_the_dashboard_is_framed_by_nobody(site: Site) -> None:
    anonymous = site.browser()
    browser = site.signed_in(site.alice)
    workspace_id = site.workspace(site.alice)
    answers = [anonymous.get("/"), anonymous.get("/ui/login"), browser.get("/"),
               browser.get("/ui/workspaces/new"), browser.get(f"/ui/workspaces/{workspace_id}"),
               browser.get("/ui/no-such-page"),
               browser.post("/ui/workspaces", data={"name": "x"})]  # 403: no CSRF token
    assert [a.status_code for a in answers] == [303, 200, 200, 200, 200, 404, 403]
    for answer in answers:
        csp = policy(answer)
        assert csp["frame-ancestors"] == ["'none'"], answer.url
        assert answer.headers["x-frame-options"] == "DENY"
        assert csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"]
        assert csp["form-action"] == ["'self'"] and csp["base-uri"] == ["'none'"]
        assert csp["default-src"] == ["'none'"]


# -------------------------------------------------------------- tokens in URLs
def refused_for_url_token(response: Response) -> bool:
    return (response.status_code == 401
            and response.headers["content-type"] == "application/problem+json"
            and "Authorization: Bearer" in response.json()["detail"]
            and "?token=" in response.json()["detail"])


def test_the_http_api_refuses_tokens_in_urls(site: Site) -> None:
    token = site.token(site.alice)
    workspace_id = site.workspace(site.alice)
    anonymous = TestClient(site.app)
    before = site.workspace_count()
    gets = ["/v1/workspaces", f"/v1/workspaces/{workspace_id}",
            f"/v1/workspaces/{workspace_id}/files", f"/v1/workspaces/{workspace_id}/api/kernels",
            f"/w/{workspace_id}/api/contents", f"/w/{workspace_id}/api/kernels",
            f"/w/{workspace_id}/api/sessions", f"/w/{workspace_id}/lab/api/settings",
            f"/w/{workspace_id}/api/me", "/v1/jobs", "/v1/credits/balance"]
    for path in gets:
        assert refused_for_url_token(anonymous.get(path, params={"token": token})), path
    for path, body in (("/v1/workspaces", {"name": "by-url"}),
                       (f"/v1/workspaces/{workspace_id}/resume", None),
                       ("/v1/jobs", {"binary": "b", "gpus": 1})):
        assert refused_for_url_token(anonymous.post(path, params={"token": token}, json=body))
    assert site.workspace_count() == before and site.desired(workspace_id) == "suspended"
    # Alongside a header, or a session cookie, the URL still carried it: refused too.
    bearer = {"Authorization": f"Bearer {token}"}
    assert refused_for_url_token(anonymous.get("/v1/workspaces", params={"token": token},
                                               headers=bearer))
    browser = site.signed_in(site.alice)
    assert refused_for_url_token(browser.get("/v1/workspaces", params={"token": token}))
    page = browser.get("/", params={"token": token})  # a dashboard page says so too
    assert page.status_code == 401 and "Authorization: Bearer" in page.text
    # The header is how: it works.
    assert anonymous.get("/v1/workspaces", headers=bearer).status_code == 200


def test_tokens_in_urls_still_open_lab_and_websockets(site: Site) -> None:
    token = site.token(site.alice)
    workspace_id = site.workspace(site.alice)
    # Jupyter's token login: the token becomes a session cookie and leaves the address.
    _, signed = open_lab(site, workspace_id)
    assert signed.headers["location"] == f"/w/{workspace_id}/lab"
    assert "nbfleet_session=" in signed.headers["set-cookie"]
    # A browser cannot put a header on a WebSocket: there ?token= is the way.
    client = TestClient(site.app)
    with client.websocket_connect(f"/w/{workspace_id}/api/events/subscribe?token={token}"):
        pass


# -------------------------------------------------------------------- cookies
def cookies_of(response: Response) -> dict[str, str]:
    return {c.split("=", 1)[0]: c for c in response.headers.get_list("set-cookie")}


def secure_flags(response: Response) -> dict[str, bool]:
    return {name: "; secure" in cookie.lower() for name, cookie in cookies_of(response).items()}


def values(response: Response) -> dict[str, str]:
    return {name: cookie.split("=", 1)[1].split(";", 1)[0]
            for name, cookie in cookies_of(response).items()}


def every_cookie_set(site: Site) -> list[dict[str, bool]]:
    """Each answer that sets or clears a cookie, from a plain-http request (what the
    control plane sees behind a TLS proxy that it does not trust). Cookies go back
    by hand: a client keeps no Secure cookie for an http URL."""
    workspace_id = site.workspace(site.alice)
    browser = site.browser()
    form = browser.get("/ui/login")
    nonce = values(form)["nbfleet_login"]
    assert f'value="{nonce}"' in form.text
    signed = site.browser().post(
        "/ui/login", data={"_xsrf": nonce, "token": site.token(site.alice), "next": "/"},
        headers={"Cookie": f"nbfleet_login={nonce}"})
    assert signed.status_code == 303, signed.text
    given = values(signed)
    out = site.browser().post("/ui/logout", data={"_xsrf": given["_xsrf"]}, headers={
        "Cookie": f"nbfleet_session={given['nbfleet_session']}"})
    assert out.status_code == 303
    _, lab = open_lab(site, workspace_id)
    answers = [secure_flags(r) for r in (form, signed, out, lab)]
    assert set(answers[0]) == {"nbfleet_login"}
    assert set(answers[1]) == {"nbfleet_session", "_xsrf", "nbfleet_login"}
    assert set(answers[2]) == set(answers[3]) == {"nbfleet_session", "_xsrf"}
    return answers


def test_cookies_are_secure_behind_tls_when_the_setting_says_so(site: Site) -> None:
    assert site.platform.config.secure_cookies == "auto"
    # auto: plain http, no Secure (a browser would drop Secure cookies on http)...
    assert not any(any(flags.values()) for flags in every_cookie_set(site))
    # ...and https, Secure.
    secure = sign_in(site.browser("https://testserver"), site.token(site.alice))
    assert all(secure_flags(secure).values())
    # always: behind a TLS proxy the request looks like plain http; Secure all the same.
    site.platform.config.secure_cookies = "always"
    assert all(all(flags.values()) for flags in every_cookie_set(site))
