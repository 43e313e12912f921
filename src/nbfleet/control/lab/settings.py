"""JupyterLab's settings, translations and layouts (``/w/{id}/lab/api/...``).

Schemas and defaults come from the installed jupyterlab (read once, through
jupyterlab_server's reader); each user's overrides are theirs alone, kept in the DB.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import tempfile
from typing import Any

import json5
from fastapi import APIRouter, Depends, Request, Response
from jsonschema import Draft7Validator, ValidationError

from nbfleet.control import workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.control.lab import userstate
from nbfleet.control.lab.assets import extension_dirs, lab_dir
from nbfleet.control.platform import Platform
from nbfleet.model.errors import InvalidInput, NotFound
from nbfleet.web.bodies import json_object
from nbfleet.web.render import iso

router = APIRouter(prefix="/w/{workspace_id}/lab/api")


def _visible(platform: Platform, principal: Principal, workspace_id: str) -> None:
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)


async def visible(workspace_id: str, request: Request,
                  principal: Principal = Depends(current_principal)) -> Principal:
    """Dependency: the caller, once the workspace is known to be theirs (else 404)."""
    await asyncio.to_thread(_visible, platform_of(request), principal, workspace_id)
    return principal


@functools.cache
def _defaults() -> dict[str, dict[str, Any]]:
    """Every plugin's schema and default entry, by id (read once: ~100 files)."""
    from jupyterlab_server.settings_utils import get_settings

    lab = lab_dir()
    with tempfile.TemporaryDirectory() as empty:
        listing, _ = get_settings(str(lab / "settings"), str(lab / "schemas"), empty,
                                  labextensions_path=list(extension_dirs()))
    return {entry["id"]: entry for entry in listing["settings"]}


def _entry(plugin: str, saved: tuple[str, Any] | None) -> dict[str, Any]:
    entry = copy.deepcopy(_defaults()[plugin])
    if saved is not None:
        raw, when = saved
        entry.update(raw=raw, settings=json5.loads(raw), last_modified=iso(when))
    return entry


@router.get("/settings")
async def list_settings(request: Request, ids_only: bool = False,
                        principal: Principal = Depends(visible)) -> dict[str, Any]:
    if ids_only:
        return {"settings": [{"id": plugin} for plugin in _defaults()]}
    saved = await asyncio.to_thread(userstate.read_prefix, platform_of(request),
                                    principal.user_id, "settings:")
    return {"settings": [_entry(plugin, saved.get(f"settings:{plugin}"))
                         for plugin in _defaults()]}


@router.get("/settings/{plugin:path}")
async def get_setting(plugin: str, request: Request,
                      principal: Principal = Depends(visible)) -> dict[str, Any]:
    if plugin not in _defaults():
        raise NotFound(f"no settings schema {plugin!r}")
    saved = await asyncio.to_thread(userstate.read, platform_of(request), principal.user_id,
                                    f"settings:{plugin}")
    return _entry(plugin, saved)


@router.put("/settings/{plugin:path}", status_code=204)
async def put_setting(plugin: str, request: Request,
                      principal: Principal = Depends(visible)) -> Response:
    """The user's raw JSON5, validated against the plugin's schema first."""
    if plugin not in _defaults():
        raise NotFound(f"no settings schema {plugin!r}")
    body = await json_object(request)
    raw = body.get("raw")
    if not isinstance(raw, str) or len(raw) > userstate.MAX_VALUE_CHARS:
        raise InvalidInput("the body must be {\"raw\": \"<JSON5 settings>\"}, under 1 MB")
    try:
        settings = json5.loads(raw) if raw.strip() else {}
        Draft7Validator(_defaults()[plugin]["schema"]).validate(settings)
    except ValidationError as exc:
        raise InvalidInput(f"settings for {plugin} do not fit its schema: {exc.message}") from exc
    except ValueError as exc:
        raise InvalidInput(f"settings for {plugin} are not valid JSON5: {exc}") from exc
    await asyncio.to_thread(userstate.write, platform_of(request), principal.user_id,
                            f"settings:{plugin}", raw)
    return Response(status_code=204)


@router.get("/translations")
def translations(principal: Principal = Depends(visible)) -> dict[str, Any]:
    from jupyterlab_server.translation_utils import get_language_packs

    data, message = get_language_packs("en")
    return {"data": data, "message": message}


@router.get("/translations/{locale}")
def translation(locale: str, principal: Principal = Depends(visible)) -> dict[str, Any]:
    from jupyterlab_server.translation_utils import get_language_pack

    data, message = get_language_pack("en" if locale == "default" else locale)
    return {"data": data, "message": message}


def _layout_key(workspace_id: str, name: str) -> str:
    return f"layout:{workspace_id}:{name}"


@router.get("/workspaces")
async def list_layouts(workspace_id: str, request: Request,
                       principal: Principal = Depends(visible)) -> dict[str, Any]:
    prefix = _layout_key(workspace_id, "")
    saved = await asyncio.to_thread(userstate.read_prefix, platform_of(request),
                                    principal.user_id, prefix)
    values = [json.loads(value) for value, _ in saved.values()]
    return {"workspaces": {"ids": [key[len(prefix):] for key in saved], "values": values}}


@router.get("/workspaces/{name}")
async def get_layout(workspace_id: str, name: str, request: Request,
                     principal: Principal = Depends(visible)) -> dict[str, Any]:
    """A layout never saved is an empty one (jupyterlab_server's answer)."""
    saved = await asyncio.to_thread(userstate.read, platform_of(request), principal.user_id,
                                    _layout_key(workspace_id, name))
    if saved is None:
        return {"data": {}, "metadata": {"id": name}}
    layout: dict[str, Any] = json.loads(saved[0])
    return layout


@router.put("/workspaces/{name}", status_code=204)
async def put_layout(workspace_id: str, name: str, request: Request,
                     principal: Principal = Depends(visible)) -> Response:
    layout = await json_object(request, limit=userstate.MAX_VALUE_CHARS)
    metadata = layout.get("metadata")
    if not isinstance(layout.get("data", {}), dict) or not isinstance(metadata, dict) \
            or metadata.get("id") != name:
        raise InvalidInput(f"a layout is {{\"data\": {{...}}, \"metadata\": {{\"id\": {name!r}}}}}")
    await asyncio.to_thread(userstate.write, platform_of(request), principal.user_id,
                            _layout_key(workspace_id, name), json.dumps(layout))
    return Response(status_code=204)


@router.delete("/workspaces/{name}", status_code=204)
async def delete_layout(workspace_id: str, name: str, request: Request,
                        principal: Principal = Depends(visible)) -> Response:
    if not await asyncio.to_thread(userstate.remove, platform_of(request), principal.user_id,
                                   _layout_key(workspace_id, name)):
        raise NotFound(f"no layout {name!r}")
    return Response(status_code=204)


@router.get("/build")
def build(principal: Principal = Depends(visible)) -> dict[str, Any]:
    """The frontend is prebuilt in the package; there is never a build to run."""
    return {"status": "stable", "message": ""}
