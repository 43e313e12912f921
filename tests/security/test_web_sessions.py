"""The browser sign-in, attacked: CSRF, forged and stolen cookies, other tenants'
pages, admin pages, XSS through names, login CSRF, open redirects, token probing
and cross-site WebSockets. Each attack must fail and leave nothing changed.

The control plane runs in-process (``create_app`` without its background loops)
on a fresh SQLite or PostgreSQL database: only the HTTP layer and the DB matter.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from starlette.testclient import WebSocketDenialResponse

from nbfleet.control import deps, websessions
from nbfleet.control.app import create_app
from nbfleet.control.auth import hash_token, new_token
from nbfleet.control.platform import ControlConfig, Platform
from nbfleet.db.engine import Database
from nbfleet.db.ids import new_id
from nbfleet.db.tables import ApiToken, User, WebSession, Workspace
from nbfleet.model.errors import DomainError
from nbfleet.web.problems import deny_websocket
from tests.support import jobs as job_support
from tests.support.ledger import Tenant, give, new_tenant

XSS = "<script>alert(1)</script>"


class Site:
    """An in-process control plane and the people using it."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.platform: Platform = app.state.platform
        self.db: Database = self.platform.db
        self.alice = new_tenant(self.db, org="alpha", project="p1", user="alice")
        self.mallory = new_tenant(self.db, org="beta", project="p1", user="mallory")
        self.neighbour = new_tenant(self.db, org="alpha", project="p2", user="neighbour")
        self.tokens: dict[str, str] = {}

    def token(self, tenant: Tenant) -> str:
        """An API token for ``tenant`` (created once, through the tenancy service)."""
        if tenant.user not in self.tokens:
            token = new_token()
            with self.db.transaction() as session:
                session.add(ApiToken(id=new_id("tok"), user_id=tenant.user_id,
                                     token_hash=hash_token(token),
                                     created_at=self.db.now(session)))
            self.tokens[tenant.user] = token
        return self.tokens[tenant.user]

    def browser(self, base_url: str = "http://testserver") -> TestClient:
        return TestClient(self.app, base_url=base_url, follow_redirects=False)

    def signed_in(self, tenant: Tenant, base_url: str = "http://testserver") -> TestClient:
        client = self.browser(base_url)
        response = sign_in(client, self.token(tenant))
        assert response.status_code == 303, response.text
        return client

    def workspace(self, tenant: Tenant, name: str = "ws") -> str:
        """A workspace row, suspended (nothing for a reconciler to do)."""
        with self.db.transaction() as session:
            now = self.db.now(session)
            ws = Workspace(id=new_id("ws"), org_id=tenant.org_id, project_id=tenant.project_id,
                           owner_id=tenant.user_id, name=name, state="suspended",
                           desired_state="suspended", generation=1, pending=False, attempts=0,
                           resources=None, created_at=now, updated_at=now)
            session.add(ws)
            return ws.id

    def desired(self, workspace_id: str) -> str:
        with self.db.transaction(write=False) as session:
            ws = session.get(Workspace, workspace_id)
            assert ws is not None
            return ws.desired_state

    def workspace_count(self) -> int:
        with self.db.transaction(write=False) as session:
            return int(session.execute(select(func.count()).select_from(Workspace)).scalar_one())


def login_nonce(client: TestClient, path: str = "/ui/login") -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="_xsrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def sign_in(client: TestClient, token: str, next_url: str = "/") -> Any:
    nonce = login_nonce(client)
    return client.post("/ui/login", data={"_xsrf": nonce, "token": token, "next": next_url})


@pytest.fixture
def site(db_url: str, tmp_path: Path) -> Iterator[Site]:
    config = ControlConfig(db_url=db_url, blobs_url=str(tmp_path / "blobs"),
                           secret=secrets.token_urlsafe(32))
    app = create_app(config, run_reconciler=False)
    with TestClient(app):  # runs the lifespan, and shuts it down afterwards
        yield Site(app)
    app.state.platform.db.dispose()


# ----------------------------------------------------------------------- CSRF
def test_cookie_requests_without_the_csrf_token_are_refused_and_change_nothing(
        site: Site) -> None:
    browser = site.signed_in(site.alice)
    ws = site.workspace(site.alice)
    other = site.signed_in(site.alice)  # a second session of the same user
    foreign_xsrf = other.cookies.get("_xsrf")
    before = site.workspace_count()
    for token in (None, "", "0" * 64, foreign_xsrf, "é" * 64, browser.cookies["_xsrf"] + "0"):
        fields = {"name": "pwned", "key": secrets.token_hex(8)}
        if token is not None:
            fields["_xsrf"] = token
        refused = browser.post("/ui/workspaces", data=fields)
        assert refused.status_code == 403, (token, refused.status_code)
        assert "XSRF" in refused.text
        for action in ("suspend", "resume", "delete"):
            form = {} if token is None else {"_xsrf": token}
            assert browser.post(f"/ui/workspaces/{ws}/{action}", data=form).status_code == 403
        # The REST API, signed in by the same cookie: a header is required there.
        headers = {} if token is None else {"X-XSRFToken": token.encode()}
        api = browser.post("/v1/workspaces", json={"name": "pwned"}, headers=headers)
        assert api.status_code == 403
        assert api.headers["content-type"] == "application/problem+json"
        assert browser.post(f"/v1/workspaces/{ws}/resume", headers=headers).status_code == 403
        assert browser.delete(f"/v1/workspaces/{ws}", headers=headers).status_code == 403
    # A token in the query string is not a form field: a link cannot carry it.
    xsrf = browser.cookies["_xsrf"]
    assert browser.post(f"/ui/workspaces/{ws}/delete?_xsrf={xsrf}", data={}).status_code == 403
    assert site.workspace_count() == before
    assert site.desired(ws) == "suspended"
    # The right token works, by form field and by header.
    assert browser.post(f"/ui/workspaces/{ws}/resume", data={"_xsrf": xsrf}).status_code == 303
    assert browser.post(f"/v1/workspaces/{ws}/suspend",
                        headers={"X-XSRFToken": xsrf}).status_code == 202
    assert site.desired(ws) == "suspended"


def test_token_requests_need_no_csrf_token(site: Site) -> None:
    client = TestClient(site.app, headers={"Authorization": f"Bearer {site.token(site.alice)}"})
    assert client.post("/v1/workspaces", json={"name": "by-token"}).status_code == 201


def test_sign_out_needs_the_csrf_token(site: Site) -> None:
    browser = site.signed_in(site.alice)
    assert browser.post("/ui/logout", data={}).status_code == 403
    assert browser.get("/").status_code == 200  # still signed in


# -------------------------------------------------------------------- cookies
def test_forged_and_stolen_looking_cookies_are_refused(site: Site) -> None:
    browser = site.signed_in(site.alice)
    secret = browser.cookies["nbfleet_session"]
    with site.db.transaction(write=False) as session:
        stored = session.execute(select(WebSession.session_hash)).scalars().all()
    forgeries = [secrets.token_urlsafe(32), secret[:-1] + ("A" if secret[-1] != "A" else "B"),
                 stored[0], "", "x" * 5000, "' OR 1=1 --"]
    for forged in forgeries:
        intruder = site.browser()
        intruder.cookies.set("nbfleet_session", forged)
        page = intruder.get("/")
        assert page.status_code == 303 and page.headers["location"] == "/ui/login"
        assert intruder.get("/ui/workspaces/new").headers["location"].startswith("/ui/login")
        assert intruder.get("/v1/workspaces").status_code == 401
        assert intruder.get("/ui/api/workspaces").status_code == 401


def test_the_session_secret_is_never_stored_in_clear(site: Site) -> None:
    browser = site.signed_in(site.alice)
    secret = browser.cookies["nbfleet_session"]
    xsrf = browser.cookies["_xsrf"]
    with site.db.transaction(write=False) as session:
        rows = session.execute(select(WebSession)).scalars().all()
    assert len(rows) == 1
    row = rows[0]
    assert row.session_hash == hashlib.sha256(secret.encode()).hexdigest()
    values = [str(getattr(row, column.key)) for column in WebSession.__table__.columns]
    assert not any(secret in value or xsrf in value for value in values)
    assert len(secret) >= 43  # 256 bits, URL-safe base64
    assert row.expires_at - row.created_at == websessions.SESSION_TTL


def test_cookie_attributes(site: Site) -> None:
    for base, secure in (("http://testserver", False), ("https://testserver", True)):
        client = site.browser(base)
        response = sign_in(client, site.token(site.alice))
        cookies = {c.split("=", 1)[0]: c for c in response.headers.get_list("set-cookie")}
        session_cookie, xsrf_cookie = cookies["nbfleet_session"], cookies["_xsrf"]
        assert "HttpOnly" in session_cookie and "HttpOnly" not in xsrf_cookie
        for cookie in (session_cookie, xsrf_cookie):
            assert "SameSite=lax" in cookie and "Path=/;" in cookie + ";"
            assert ("Secure" in cookie) is secure


def test_a_revoked_or_expired_session_no_longer_works(site: Site) -> None:
    browser = site.signed_in(site.alice)
    stolen = dict(browser.cookies)
    assert browser.post("/ui/logout", data={"_xsrf": stolen["_xsrf"]}).status_code == 303
    replay = site.browser()
    for name, value in stolen.items():
        replay.cookies.set(name, value)
    assert replay.get("/").status_code == 303
    assert replay.get("/v1/workspaces").status_code == 401
    assert replay.post("/v1/workspaces", json={"name": "x"},
                       headers={"X-XSRFToken": stolen["_xsrf"]}).status_code == 401
    with site.db.transaction(write=False) as session:
        assert session.execute(select(WebSession.revoked_at)).scalar_one() is not None

    other = site.signed_in(site.alice)
    assert other.get("/").status_code == 200
    with site.db.transaction() as session:
        session.execute(update(WebSession).where(WebSession.revoked_at.is_(None)).values(
            expires_at=site.db.now(session) - timedelta(seconds=1)))
    assert other.get("/").status_code == 303
    assert other.get("/v1/workspaces").status_code == 401


def test_housekeeping_purges_sessions_long_expired_and_keeps_live_ones(site: Site) -> None:
    stale = site.signed_in(site.alice)
    with site.db.transaction() as session:
        session.execute(update(WebSession).values(
            expires_at=site.db.now(session) - timedelta(days=2)))
    live = site.signed_in(site.alice)
    assert websessions.purge_expired(site.db) == 1
    with site.db.transaction(write=False) as session:
        assert session.execute(select(func.count()).select_from(WebSession)).scalar_one() == 1
    assert live.get("/").status_code == 200 and stale.get("/").status_code == 303


def test_signing_in_again_replaces_the_session(site: Site) -> None:
    browser = site.signed_in(site.alice)
    first = browser.cookies["nbfleet_session"]
    assert browser.get("/ui/login").status_code == 303  # signed in: nothing to do there
    browser.cookies.delete("nbfleet_session")
    nonce = login_nonce(browser)
    browser.cookies.set("nbfleet_session", first)
    again = browser.post("/ui/login", data={"_xsrf": nonce, "token": site.token(site.alice)})
    assert again.status_code == 303
    fresh = again.headers["set-cookie"].split("nbfleet_session=", 1)[1].split(";", 1)[0]
    assert fresh and fresh != first
    replay = site.browser()
    replay.cookies.set("nbfleet_session", first)
    assert replay.get("/v1/workspaces").status_code == 401


# -------------------------------------------------------------------- tenancy
def test_other_tenants_pages_and_actions_are_404(site: Site) -> None:
    ws = site.workspace(site.alice, "alice-private")
    site.platform.files.put(ws, "secret.txt", b"s3cret")
    tenant = site.alice
    site.token(tenant)
    job_support.register(site.db)
    job_support.add_host(site.db, "h1", [(1, "A100-80GB", 80)])
    give(site.db, tenant.owner(site.db), 10**12)
    job = job_support.submit(site.db, tenant, name="alice-job").id
    for outsider in (site.mallory, site.neighbour):
        browser = site.signed_in(outsider)
        xsrf = browser.cookies["_xsrf"]
        for path in (f"/ui/workspaces/{ws}", f"/ui/workspaces/{ws}/files/secret.txt",
                     f"/ui/jobs/{job}"):
            page = browser.get(path)
            assert page.status_code == 404, path
            assert "s3cret" not in page.text and "alice" not in page.text
        for action in ("suspend", "resume", "delete"):
            response = browser.post(f"/ui/workspaces/{ws}/{action}", data={"_xsrf": xsrf})
            assert response.status_code == 404
        for path in ("/", "/ui/api/workspaces", "/ui/jobs"):
            assert ws not in browser.get(path).text and job not in browser.get(path).text
        # Naming the other tenant's wallet answers as if it did not exist.
        assert browser.get("/ui/credits?org=alpha&project=p1").status_code == 404
    assert site.desired(ws) == "suspended"


def test_admin_pages_do_not_exist_for_users(site: Site) -> None:
    browser = site.signed_in(site.alice)
    xsrf = browser.cookies["_xsrf"]
    for path in ("/ui/admin/fleet", "/ui/admin/users", "/ui/admin/orgs", "/ui/admin/grants"):
        page = browser.get(path)
        assert page.status_code == 404, path
        assert "Fleet" not in page.text  # no admin navigation either
    created = browser.post("/ui/admin/users", data={"_xsrf": xsrf, "name": "evil",
                                                    "org": "alpha", "project": "p1",
                                                    "admin": "on"})
    assert created.status_code == 404 and "nbf_" not in created.text
    granted = browser.post("/ui/admin/grants", data={"_xsrf": xsrf, "org": "alpha",
                                                     "project": "p1", "kind": "promo",
                                                     "amount": "1000000", "key": "k"})
    assert granted.status_code == 404
    assert "/ui/admin" not in browser.get("/").text


# ------------------------------------------------------------------------ XSS
def test_names_are_escaped_on_every_page(site: Site) -> None:
    ws = site.workspace(site.alice, XSS)
    site.platform.files.put(ws, f"{XSS}.txt".replace("/", "_"), b"x")
    job_support.register(site.db)
    job_support.add_host(site.db, "h1", [(1, "A100-80GB", 80)])
    give(site.db, site.alice.owner(site.db), 10**12)
    job = job_support.submit(site.db, site.alice, name=XSS).id
    browser = site.signed_in(site.alice)
    pages = ["/", f"/ui/workspaces/{ws}", "/ui/jobs", f"/ui/jobs/{job}", "/ui/credits",
             f"/ui/workspaces/{XSS}", f"/ui/nothing/{XSS}", f"/ui/login?next=/%22%3E{XSS}"]
    for path in pages:
        page = browser.get(path)
        assert page.status_code in (200, 303, 404), path
        assert "<script>alert" not in page.text, path
        assert "script-src 'self'" in page.headers.get("content-security-policy", ""), path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in browser.get("/").text
    # An admin's pages show user-typed memos and names too.
    admin = site.token(new_admin(site))
    boss = site.browser()
    assert sign_in(boss, admin).status_code == 303
    xsrf = boss.cookies["_xsrf"]
    assert boss.post("/ui/admin/grants", data={
        "_xsrf": xsrf, "key": "k1", "org": "alpha", "project": "p1", "kind": "promo",
        "amount": "1", "memo": XSS}).status_code == 303
    for path in ("/", "/ui/admin/grants", "/ui/admin/users", "/ui/admin/orgs",
                 "/ui/admin/fleet", f"/ui/workspaces/{ws}"):
        page = boss.get(path)
        assert page.status_code == 200, path
        assert "<script>alert" not in page.text, path


def new_admin(site: Site) -> Tenant:
    tenant = new_tenant(site.db, org="system", project="default", user="root")
    with site.db.transaction() as session:
        session.execute(update(User).where(User.id == tenant.user_id).values(is_admin=True))
    return tenant


def test_downloads_never_render_as_pages(site: Site) -> None:
    ws = site.workspace(site.alice)
    site.platform.files.put(ws, "page.html", b"<html><script>alert(1)</script></html>")
    browser = site.signed_in(site.alice)
    response = browser.get(f"/ui/workspaces/{ws}/files/page.html")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["content-disposition"].startswith("attachment;")
    assert response.headers["x-content-type-options"] == "nosniff"
    assert browser.get(f"/ui/workspaces/{ws}/files/../../etc/passwd").status_code in (404, 422)


# --------------------------------------------------------------------- sign-in
def test_login_csrf_and_open_redirects_are_refused(site: Site) -> None:
    token = site.token(site.alice)
    # Another site posting its token: no login cookie, or a foreign Origin.
    forged = site.browser().post("/ui/login", data={"_xsrf": "x", "token": token})
    assert forged.status_code == 403
    assert "nbfleet_session" not in forged.headers.get("set-cookie", "")
    browser = site.browser()
    nonce = login_nonce(browser)
    cross = browser.post("/ui/login", data={"_xsrf": nonce, "token": token},
                         headers={"Origin": "https://evil.example"})
    assert cross.status_code == 403
    assert "nbfleet_session" not in cross.headers.get("set-cookie", "")
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example",
                   "javascript:alert(1)", "/%0d%0aSet-Cookie:x=1"):
        client = site.browser()
        response = sign_in(client, token, target)
        assert response.status_code == 303
        location = response.headers["location"]
        assert location.startswith("/") and not location.startswith("//"), target
        assert "evil" not in location and "\r" not in location


def test_sign_in_reveals_nothing_and_limits_failures(site: Site) -> None:
    revoked = site.token(site.mallory)
    with site.db.transaction() as session:
        session.execute(update(ApiToken).where(ApiToken.user_id == site.mallory.user_id)
                        .values(revoked_at=site.db.now(session)))
    answers = set()
    browser = site.browser()
    for attempt in ("nbf_" + secrets.token_urlsafe(32), revoked, "", "x" * 300):
        response = sign_in(browser, attempt)
        assert response.status_code == 401
        assert "invalid token" in response.text
        answers.add(re.sub(r'value="[^"]*"', "", response.text))
    assert len(answers) == 1  # the same page whatever the token was
    for _ in range(6):
        sign_in(browser, "nbf_wrong")
    limited = sign_in(browser, site.token(site.alice))
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    assert "nbfleet_session" not in limited.headers.get("set-cookie", "")


# ------------------------------------------------------------------ WebSockets
def socket_app(platform: Platform) -> FastAPI:
    """A WebSocket route guarded as the kernel channels are to be."""
    app = FastAPI()

    @app.websocket("/ws")
    async def guarded(websocket: WebSocket) -> None:
        try:
            principal = deps.principal_of_websocket(platform, websocket)
        except DomainError as exc:
            await deny_websocket(websocket, exc)
            return
        await websocket.accept()
        await websocket.send_text(principal.user_id)
        await websocket.close()

    return app


def test_cookie_websockets_from_another_origin_are_refused(site: Site) -> None:
    browser = site.signed_in(site.alice)
    secret = browser.cookies["nbfleet_session"]
    client = TestClient(socket_app(site.platform))  # its handshakes say Host: testserver
    cookie = {"Cookie": f"nbfleet_session={secret}"}

    def connect(headers: dict[str, str], path: str = "/ws") -> str | int:
        try:
            with client.websocket_connect(path, headers=headers) as socket:
                return str(socket.receive_text())
        except WebSocketDenialResponse as denied:
            return int(denied.status_code)

    for origin in ("https://evil.example", "http://testserver.evil", "http://testserver:8080",
                   "null", "file://", "http://evil@"):
        assert connect({**cookie, "Origin": origin}) == 403, origin
    assert connect({**cookie, "Origin": "http://testserver"}) == site.alice.user_id
    assert connect({**cookie, "Origin": "http://TestServer:80"}) == site.alice.user_id
    assert connect(cookie) == site.alice.user_id  # no Origin: not a browser
    # A forged cookie is no session at all; a token is not ambient, so any Origin.
    assert connect({"Cookie": "nbfleet_session=forged", "Origin": "http://testserver"}) == 401
    token = site.token(site.alice)
    assert connect({"Origin": "https://evil.example"}, f"/ws?token={token}") == \
        site.alice.user_id
    assert browser.post("/ui/logout", data={"_xsrf": browser.cookies["_xsrf"]}
                        ).status_code == 303
    assert connect(cookie) == 401


def test_same_origin() -> None:
    same = websessions.same_origin
    assert same("http://a.example:80", "a.example")
    assert same("https://a.example", "a.example:443")
    assert same("http://[::1]:8765", "[::1]:8765")
    assert not same("https://a.example", "a.example:80")
    assert not same("http://a.example:99999", "a.example:99999")
    assert not same("http://a.example", "a.example:notaport")
    assert not same(None, "a.example") and not same("http://a.example", None)
