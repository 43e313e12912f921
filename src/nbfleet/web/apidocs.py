"""Swagger UI at ``/docs`` from assets installed with nbfleet, so the API docs work on
a host with no internet (FastAPI's own ``/docs`` loads them from a CDN).

The page and its assets are served by the control plane itself: every ``src`` and
``href`` in the page is a path on this origin. ReDoc is not in the bundle, so
``/redoc`` is not served.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

from nbfleet.model.errors import NotFound

DOCS_PATH = "/docs"
ASSETS_PATH = f"{DOCS_PATH}/assets"

#: The only files served from the bundle: what the page loads, and the source maps
#: a browser's developer tools ask for. Not its demo page (it points at the petstore).
ASSETS = frozenset({"swagger-ui-bundle.js", "swagger-ui-bundle.js.map", "swagger-ui.css",
                    "swagger-ui.css.map", "favicon-32x32.png", "favicon-16x16.png"})

#: The bundle's files are immutable per installed version; a day's caching is safe
#: and an upgrade is picked up by the next day at the latest.
CACHE = {"Cache-Control": "public, max-age=86400"}


def asset_dir() -> Path:
    """The directory of the installed Swagger UI release."""
    return Path(str(swagger_ui_path))


def docs_page(openapi_url: str, title: str) -> HTMLResponse:
    """The Swagger UI page: local script, style and icon; no validator badge (Swagger
    UI would fetch it from validator.swagger.io)."""
    return get_swagger_ui_html(
        openapi_url=openapi_url, title=f"{title} - API docs",
        swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS_PATH}/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None},
    )


def mount_api_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and its assets offline (ReDoc is not bundled: no ``/redoc``)."""
    openapi_url = app.openapi_url
    if openapi_url is None:  # no schema, nothing to document
        return
    folder = asset_dir()

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return docs_page(openapi_url, app.title)

    @app.get(f"{ASSETS_PATH}/{{name}}", include_in_schema=False)
    async def swagger_asset(name: str) -> FileResponse:
        # An allowlist, not a directory: no other file of the package, and no path
        # that could leave the folder, is ever reachable.
        if name not in ASSETS:
            raise NotFound(f"no API docs asset {name!r}")
        return FileResponse(folder / name, headers=CACHE)
