"""The web dashboard at ``/``: every page's routes, its static assets, and a
readable 404 for any other ``/ui`` path. ``router`` is what the app includes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nbfleet.control.dashboard import (
    admin_pages,
    job_pages,
    money_pages,
    signin,
    workspace_pages,
)
from nbfleet.control.dashboard.pages import STATIC, PageRoute, error_page

router = APIRouter(include_in_schema=False)

#: The assets, read once: a fixed set of names, so no path from a URL reaches the disk.
_MEDIA = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".svg": "image/svg+xml"}
ASSETS = {path.name: (path.read_bytes(), _MEDIA[path.suffix])
          for path in STATIC.iterdir() if path.is_file() and path.suffix in _MEDIA}

assets = APIRouter(include_in_schema=False)


@assets.get("/ui/static/{name}")
def static_asset(name: str) -> Response:
    """Cached for a day: their URLs carry a content hash (``pages.static_url``)."""
    found = ASSETS.get(name)
    if found is None:
        return Response("not found", status_code=404, media_type="text/plain")
    body, media = found
    return Response(body, media_type=media, headers={
        "Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})


fallback = APIRouter(route_class=PageRoute, include_in_schema=False)


@fallback.get("/ui/{rest:path}")
def not_found(rest: str, request: Request) -> Response:
    return error_page(request, 404, "There is no such page.")


for part in (assets, signin.router, workspace_pages.router, workspace_pages.api,
             money_pages.router, job_pages.router, admin_pages.router, fallback):
    router.include_router(part)
