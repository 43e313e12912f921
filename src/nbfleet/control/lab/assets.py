"""JupyterLab's frontend files, served from the installed ``jupyterlab`` package
(and its prebuilt extensions): the same for every workspace, so cached once."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse

from nbfleet.model.errors import NotFound

router = APIRouter()

STATIC_URL = "/lab-static"
#: Below a workspace's base URL, where Lab's page config says jupyterlab_server has them.
EXTENSIONS_PATH = "lab/extensions"
THEMES_PATH = "lab/api/themes"


def _data_dirs() -> list[Path]:
    """Where pip put ``share/jupyter``: this environment's prefix first."""
    seen: list[Path] = []
    for prefix in (sys.prefix, sys.base_prefix, "/usr/local", "/usr"):
        path = Path(prefix) / "share" / "jupyter"
        if path.is_dir() and path not in seen:
            seen.append(path)
    return seen


@functools.cache
def lab_dir() -> Path:
    for data in _data_dirs():
        if (data / "lab" / "static" / "index.html").is_file():
            return data / "lab"
    raise RuntimeError("JupyterLab's frontend is not installed (pip install jupyterlab)")


@functools.cache
def extension_dirs() -> tuple[str, ...]:
    return tuple(str(d / "labextensions") for d in _data_dirs()
                 if (d / "labextensions").is_dir())


@functools.cache
def federated_extensions() -> tuple[dict[str, Any], ...]:
    """The prebuilt extensions, as page config lists them (jupyterlab_server's reader)."""
    from jupyterlab_server.config import get_federated_extensions

    found = get_federated_extensions(list(extension_dirs()))
    out: list[dict[str, Any]] = []
    for data in found.values():
        build = data["jupyterlab"].get("_build")
        if not build:
            continue
        entry = {"name": data["name"], "load": build["load"]}
        for key in ("extension", "mimeExtension", "style"):
            if key in build:
                entry[key] = build[key]
        entry["entrypoints"] = build.get("entrypoints")
        out.append(entry)
    return tuple(out)


@functools.cache
def _favicons() -> Path:
    import jupyter_server

    return Path(jupyter_server.__file__).parent / "static" / "favicons"


def _file(root: Path, relative: str) -> FileResponse:
    """A file below ``root`` (never outside it: ``..`` and links out are 404). They
    change only when jupyterlab is upgraded, and most names carry a content hash."""
    base = root.resolve()
    target = (base / relative).resolve()
    if not relative or not target.is_relative_to(base) or not target.is_file():
        raise NotFound(f"no such file: {relative}")
    return FileResponse(target, headers={"Cache-Control": "public, max-age=86400",
                                         "X-Content-Type-Options": "nosniff"})


@router.get(STATIC_URL + "/{path:path}")
def static(path: str) -> FileResponse:
    return _file(lab_dir() / "static", path)


@router.get("/w/{workspace_id}/" + EXTENSIONS_PATH + "/{path:path}")
def extension_file(path: str) -> FileResponse:
    return extension(path)


def extension(path: str) -> FileResponse:
    for directory in extension_dirs():
        try:
            return _file(Path(directory), path)
        except NotFound:
            continue
    raise NotFound(f"no such file: {path}")


@router.get("/w/{workspace_id}/" + THEMES_PATH + "/{path:path}")
def theme(path: str) -> FileResponse:
    try:
        return _file(lab_dir() / "themes", path)
    except NotFound:
        # A prebuilt extension's theme: NAME/index.css lives in NAME/themes/NAME/.
        return extension(_extension_theme(path))


def _extension_theme(path: str) -> str:
    parts = path.split("/")
    depth = 2 if parts[0].startswith("@") else 1
    name = "/".join(parts[:depth])
    return os.path.join(name, "themes", name, *parts[depth:])


@router.get("/w/{workspace_id}/static/favicons/{name}")
def favicon(workspace_id: str, name: str) -> FileResponse:
    return _file(_favicons(), name)
