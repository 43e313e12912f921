"""The JupyterLab page of a workspace (``/w/{id}/lab``) and the small server
endpoints Lab asks about at start (identity, status, frontend config).

The page is jupyterlab's own ``index.html`` template, rendered with a page config
that points every URL at nbfleet: contents, sessions and kernels are the
workspace's. Opening it on a suspended workspace starts the resume, and a small
banner above Lab says so until the workspace runs.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any
from urllib.parse import quote

import jinja2
import markupsafe
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy import select

from nbfleet import __version__
from nbfleet.control import websessions, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import cookies_secure, platform_of, principal_of
from nbfleet.control.lab import userstate
from nbfleet.control.lab.assets import (
    EXTENSIONS_PATH,
    STATIC_URL,
    THEMES_PATH,
    federated_extensions,
    lab_dir,
)
from nbfleet.control.lab.settings import visible
from nbfleet.control.platform import Platform
from nbfleet.db.tables import User
from nbfleet.model.errors import InvalidInput, Unauthorized
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.web.bodies import json_object
from nbfleet.web.browser import LAB_HEADERS

router = APIRouter()

SIGN_IN_URL = "/ui/login"

#: Extensions that call out to the internet or manage a server nbfleet is not:
#: the extension manager (PyPI listings, installs), the news feed, and terminals.
DISABLED_EXTENSIONS = [
    "@jupyterlab/extensionmanager-extension",
    "@jupyterlab/apputils-extension:announcements",
    "@jupyterlab/terminal-extension",
]

#: Messages jupyter_server does not count as activity (its page config's list).
UNTRACKED = ["comm_info_request", "comm_info_reply", "kernel_info_request",
             "kernel_info_reply", "shutdown_request", "shutdown_reply", "interrupt_request",
             "interrupt_reply", "debug_request", "debug_reply", "stream", "display_data",
             "update_display_data", "execute_input", "execute_result", "error", "status",
             "clear_output", "debug_event", "input_request", "input_reply"]


@functools.cache
def _template() -> jinja2.Template:
    source = (lab_dir() / "static" / "index.html").read_text(encoding="utf-8")
    env = jinja2.Environment(autoescape=True)
    return env.from_string(source)


@functools.cache
def _lab_version() -> str:
    data = json.loads((lab_dir() / "static" / "package.json").read_text(encoding="utf-8"))
    version: str = data.get("version", "")
    return version


def page_config(workspace_id: str) -> dict[str, Any]:
    """As jupyterlab_server builds it: ``full*`` URLs are absolute, the others are
    joined to ``baseUrl`` by Lab."""
    base = f"/w/{workspace_id}/"
    paths = {"App": "lab", "Labextensions": EXTENSIONS_PATH, "Licenses": "lab/api/licenses",
             "Settings": "lab/api/settings", "Themes": THEMES_PATH,
             "TranslationsApi": "lab/api/translations", "Tree": "lab/tree",
             "WorkspacesApi": "lab/api/workspaces"}
    urls: dict[str, str] = {}
    for name, path in paths.items():
        short = name[0].lower() + name[1:]
        urls[f"{short}Url"] = f"/{path}"
        urls[f"full{name}Url"] = f"{base}{path}"
    return {
        **urls,
        "appName": "JupyterLab", "appNamespace": "lab", "appVersion": _lab_version(),
        "baseUrl": base, "wsUrl": "", "fullStaticUrl": STATIC_URL,
        "fullListingsUrl": "", "listingsUrl": "", "fullMathjaxUrl": "",
        "buildAvailable": False, "buildCheck": False, "cacheFiles": False,
        "devMode": False, "disabledExtensions": DISABLED_EXTENSIONS,
        "exposeAppInBrowser": False, "extensionManager": {"can_install": False, "name": ""},
        "federated_extensions": list(federated_extensions()), "ignorePlugins": [],
        "mode": "multiple-document", "news": {"disabled": True}, "notebookStartsKernel": True,
        "preferredPath": "/", "quitButton": False, "store_id": 0, "terminalsAvailable": False,
        "token": "", "treePath": "", "untracked_message_types": UNTRACKED,
        "workspace": "default", "allow_hidden_files": False, "delete_to_trash": False,
    }


def _open(platform: Platform, principal: Principal, workspace_id: str) -> tuple[str, bool]:
    """The workspace's name; a suspended one is asked to resume (True if it was)."""
    with platform.db.transaction() as session:
        ws = workspaces.get_visible(session, principal, workspace_id, for_update=True)
        if ws.desired_state == DesiredState.DELETED or ws.state in (
                WorkspaceState.DELETING, WorkspaceState.DELETED):
            raise InvalidInput(f"workspace {workspace_id} is being deleted")
        if ws.desired_state == DesiredState.SUSPENDED:
            workspaces.request_state(ws, DesiredState.RUNNING, platform.db.now(session))
            return ws.name, True
        return ws.name, ws.state != WorkspaceState.RUNNING


_BANNER = """<div id="nbfleet-banner" role="status" aria-live="polite" style="position:fixed;
top:0;left:50%;transform:translateX(-50%);z-index:10000;background:#1f4e8c;color:#fff;
font:14px system-ui,sans-serif;padding:6px 14px;border-radius:0 0 6px 6px">Resuming workspace
<b>{name}</b>&hellip;</div><script>(function(){{var b=document.getElementById(
'nbfleet-banner'),u={status_url};function poll(){{fetch(u,{{credentials:'same-origin',
headers:{{}}}}).then(function(r){{return r.json()}}).then(function(w){{
if(w.state==='running'){{b.textContent='Workspace resumed: your variables are back.';
setTimeout(function(){{b.remove()}},4000)}}else{{if(w.last_error){{b.textContent=
'Resuming: '+w.last_error}}setTimeout(poll,1000)}}}}).catch(function(){{setTimeout(poll,2000)
}})}}poll()}})()</script>"""


def _banner(workspace_id: str, name: str) -> str:
    return _BANNER.format(name=markupsafe.escape(name),
                          status_url=json.dumps(f"/v1/workspaces/{workspace_id}"))


@router.get("/w/{workspace_id}")
@router.get("/w/{workspace_id}/")
def to_lab(workspace_id: str) -> RedirectResponse:
    return RedirectResponse(f"/w/{quote(workspace_id)}/lab", status_code=302)


@router.get("/w/{workspace_id}/lab")
@router.get("/w/{workspace_id}/lab/{rest:path}")
async def lab(workspace_id: str, request: Request, rest: str = "") -> Response:
    """Signed out: off to sign in, and back here after. A token in the URL (as
    Jupyter's token login) signs the browser in with a session cookie and is
    dropped from the address: Lab opens its WebSockets with cookies only. The page
    goes out with ``LAB_HEADERS`` (its Content-Security-Policy, no framing by other
    sites)."""
    platform = platform_of(request)
    try:
        principal = await asyncio.to_thread(principal_of, request, None, True)
    except Unauthorized:
        target = quote(request.url.path, safe="/")
        return RedirectResponse(f"{SIGN_IN_URL}?next={target}", status_code=303)
    if "token" in request.query_params:
        return await _sign_in_here(request, principal)
    name, resuming = await asyncio.to_thread(_open, platform, principal, workspace_id)
    if resuming:
        platform.wake()
    # No token in the page: the session cookie authenticates Lab's calls.
    html = _template().render(page_config=page_config(workspace_id),
                              base_url=f"/w/{workspace_id}/", ws_url="", custom_css=False)
    if resuming:
        html = html.replace("<body", "<body data-nbfleet-resuming", 1)
        html = html.replace("</body>", _banner(workspace_id, name) + "</body>", 1)
    return HTMLResponse(html, headers=LAB_HEADERS)


async def _sign_in_here(request: Request, principal: Principal) -> Response:
    platform = platform_of(request)
    started = await asyncio.to_thread(websessions.start, platform.db, platform.config.secret,
                                      principal.user_id)
    response = RedirectResponse(quote(request.url.path, safe="/"), status_code=303)
    websessions.set_cookies(response, started, secure=cookies_secure(request),
                            max_age=int(websessions.SESSION_TTL.total_seconds()))
    return response


def _identity(platform: Platform, principal: Principal) -> dict[str, Any]:
    with platform.db.transaction(write=False) as session:
        name = session.execute(select(User.name).where(User.id == principal.user_id)).scalar()
    name = name or principal.user_id
    return {"username": name, "name": name, "display_name": name,
            "initials": "".join(part[:1] for part in name.split()[:2]).upper() or name[:1],
            "avatar_url": None, "color": None}


@router.get("/w/{workspace_id}/api/me")
async def me(request: Request, principal: Principal = Depends(visible)) -> dict[str, Any]:
    identity = await asyncio.to_thread(_identity, platform_of(request), principal)
    return {"identity": identity, "permissions": {}}


@router.get("/w/{workspace_id}/api/status")
def status(principal: Principal = Depends(visible)) -> dict[str, Any]:
    return {"version": __version__, "started": None, "last_activity": None,
            "kernels": None, "connections": None}


@router.get("/w/{workspace_id}/api/config/{section}")
async def get_config(section: str, request: Request,
                     principal: Principal = Depends(visible)) -> dict[str, Any]:
    if len(section) > 100:
        raise InvalidInput("a config section's name has at most 100 characters")
    saved = await asyncio.to_thread(userstate.read, platform_of(request), principal.user_id,
                                    f"config:{section}")
    config: dict[str, Any] = json.loads(saved[0]) if saved else {}
    return config


@router.patch("/w/{workspace_id}/api/config/{section}")
async def patch_config(section: str, request: Request,
                       principal: Principal = Depends(visible)) -> dict[str, Any]:
    """Merge, as jupyter_server's config sections do (a null removes a key)."""
    platform = platform_of(request)
    update = await json_object(request, limit=100_000)
    config = await get_config(section, request, principal)
    for key, value in update.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    await asyncio.to_thread(userstate.write, platform, principal.user_id, f"config:{section}",
                            json.dumps(config))
    return config


@router.get("/w/{workspace_id}/api/nbconvert")
def nbconvert_formats(principal: Principal = Depends(visible)) -> dict[str, Any]:
    """No export formats: the control plane runs no nbconvert (planned)."""
    return {}


@router.get("/w/{workspace_id}/lsp/status")
def lsp_status(principal: Principal = Depends(visible)) -> dict[str, Any]:
    """No language servers run beside the kernels (yet)."""
    return {"version": 2, "sessions": {}, "specs": {}}

