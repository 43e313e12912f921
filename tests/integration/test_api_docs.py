"""``/docs`` works with no internet: the page and everything it loads come from the
control plane itself (issue 15)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx

from tests.support.cluster import Cluster


class Links(HTMLParser):
    """Every ``src`` and ``href`` in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.extend(value for name, value in attrs if name in ("src", "href") and value)


def test_the_docs_page_loads_only_from_its_own_origin(shared_cluster: Cluster) -> None:
    page = httpx.get(f"{shared_cluster.url}/docs", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    links = Links()
    links.feed(page.text)
    assert len(links.found) >= 3, links.found  # script, style, icon
    origin = urlsplit(shared_cluster.url)[:2]
    for link in links.found:
        target = urljoin(f"{shared_cluster.url}/docs", link)
        assert urlsplit(target)[:2] == origin, link
        loaded = httpx.get(target, timeout=30)
        assert loaded.status_code == 200 and loaded.content, (link, loaded.status_code)
    # Nor does the page's script name another host: no URL with a scheme, nor a
    # protocol-relative one, anywhere in the page.
    assert not re.search(r"(?i)\b[a-z][a-z0-9+.-]*://|['\"(]//", page.text), page.text
    assert '"validatorUrl": null' in page.text  # no badge from validator.swagger.io
    [spec_url] = re.findall(r"url: '([^']+)'", page.text)
    spec = httpx.get(urljoin(f"{shared_cluster.url}/docs", spec_url), timeout=30)
    assert spec.status_code == 200 and spec.json()["info"]["title"] == "nbfleet"
    assert "/v1/workspaces" in spec.json()["paths"]


def test_only_the_bundles_assets_are_served(shared_cluster: Cluster) -> None:
    """An allowlist: not the bundle's demo page (it loads the petstore from the
    internet), not a path out of its folder, and no ReDoc (it is not bundled)."""
    base = shared_cluster.url
    script = httpx.get(f"{base}/docs/assets/swagger-ui-bundle.js", timeout=30)
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text
    assert "javascript" in script.headers["content-type"]
    for path in ("/docs/assets/index.html", "/docs/assets/swagger-initializer.js",
                 "/docs/assets/..%2F__init__.py", "/docs/assets/%2E%2E%2F%2E%2E%2Fpyproject.toml",
                 "/docs/assets/", "/redoc"):
        answer = httpx.get(f"{base}{path}", timeout=30)
        assert answer.status_code == 404, (path, answer.status_code)
    assert "petstore" not in httpx.get(f"{base}/docs", timeout=30).text
