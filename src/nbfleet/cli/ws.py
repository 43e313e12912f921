"""``nbfleet ws ...``: workspaces and their files."""

from __future__ import annotations

import math
import os
import re
import sys
import time
import uuid
import webbrowser
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import typer

from nbfleet.cli.client import (
    JSON_OPT,
    TOKEN_OPT,
    URL_OPT,
    Api,
    err,
    print_json,
    print_table,
    when,
)
from nbfleet.model.errors import InvalidInput
from nbfleet.model.limits import format_size, parse_size

app = typer.Typer(help="Create, suspend, resume and delete workspaces; manage their files.",
                  no_args_is_help=True)

WAIT_OPT = typer.Option(False, "--wait", help="Wait until the workspace settles")


def _settled(body: dict[str, Any]) -> bool:
    """The requested state is reached. ``failed`` is not an end: the control plane
    retries a failed placement until it succeeds or another state is asked for."""
    return bool(body["state"] == body["desired_state"])


#: How long one request may wait on the server before the CLI polls instead.
SERVER_WAIT_S = 50  # under the client's 60 s timeout
#: How long ``--wait`` then polls before saying the change is still in progress.
POLL_S = 120.0

_PROGRESS = {"create": "creating", "suspend": "suspending", "resume": "resuming",
             "delete": "deleting"}


def _describe(body: dict[str, Any]) -> str:
    if body["state"] == "failed" and body.get("last_error"):
        return f"state: failed, retrying ({body['last_error']})"
    return f"state: {body['state']}"


def _wait(api: Api, workspace_id: str, verb: str, body: dict[str, Any],
          started: float) -> dict[str, Any]:
    """Wait until the workspace settles; if it has not by then, print where it
    stands and exit 1 saying it is still in progress (it has not failed)."""
    if not _settled(body):
        body = api.wait_for(f"/v1/workspaces/{workspace_id}", _settled, timeout_s=POLL_S,
                            describe=_describe, give_up=False)
    if _settled(body):
        return body
    print_json(body)
    elapsed = time.monotonic() - started
    note = (f"; its last attempt failed ({body['last_error']}) and is being retried"
            if body.get("last_error") else "")
    err.print(f"{verb} of {workspace_id}: still {_PROGRESS.get(verb, 'in progress')} after "
              f"{elapsed:.0f} s (state {body['state']}{note}); "
              f"`nbfleet ws get {workspace_id}` shows when it is done")
    raise typer.Exit(1)


def _change(api: Api, workspace_id: str, verb: str, wait: bool) -> None:
    started = time.monotonic()
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    if verb == "delete":
        body = api.json("DELETE", f"/v1/workspaces/{workspace_id}", headers=headers)
    else:
        params = {"wait": SERVER_WAIT_S} if wait else {}
        body = api.json("POST", f"/v1/workspaces/{workspace_id}/{verb}", headers=headers,
                        params=params)
    generation = body.get("generation")
    if wait:
        body = _wait(api, workspace_id, verb, body, started)
    print_json(body)
    if wait and verb == "resume":
        _tell_restored(body, generation)


def _tell_restored(body: dict[str, Any], generation: int | None) -> None:
    """One line per kernel on stderr: what this resume brought back and what not.

    The summary must be this resume's: one recorded for another generation (an
    earlier resume) is never shown as if it were.
    """
    summary = body.get("restore") or {}
    if generation is None or summary.get("generation") != generation:
        # The server answers a resume of a workspace that was already running with
        # no summary: that resume restored nothing (the one on record is older).
        if (body.get("snapshot") or {}).get("kernels"):
            err.print("no restore report for this resume (nothing was restored by it: the "
                      "workspace was already running, or another request resumed it)")
        return
    for kernel_id, report in (summary.get("kernels") or {}).items():
        if report.get("files_only"):
            err.print(f"kernel {kernel_id}: files only ({report.get('error')})")
            continue
        lost = ", ".join(f"{x['name']} ({x['type']})" for x in report.get("lost", []))
        changed = ", ".join(f"{x['name']} ({x['reason']})" for x in report.get("changed", []))
        settings = ", ".join(f"{x['name']} ({x.get('reason') or 'lost'})"
                             for x in report.get("settings", []) if x.get("status") == "lost")
        err.print(f"kernel {kernel_id} ({report.get('path')} start): restored "
                  f"{len(report.get('restored', []))} variables"
                  + (f", recomputed {', '.join(report['recomputed'])}"
                     if report.get("recomputed") else "")
                  + (f"; came back changed: {changed}" if changed else "")
                  + (f"; not restored: {lost}" if lost else "")
                  + (f"; settings not restored: {settings}" if settings else ""))
    for kernel_id in summary.get("unreported", []):
        err.print(f"kernel {kernel_id}: restored by an earlier attempt whose report was lost")


#: A GPU type as agents declare it (the API checks the same), e.g. A100-80GB.
_GPU_TYPE = re.compile(r"^[A-Za-z0-9]+-[0-9]+GB$")

GPUS_OPT = typer.Option(None, "--gpus", min=0, max=64,
                        help="GPUs, all of one type (default: the project's default request)")
GPU_TYPE_OPT = typer.Option(None, "--gpu-type", help="An acceptable GPU type, e.g. A100-80GB; "
                            "repeat it, most preferred first (default: any)")
VRAM_OPT = typer.Option(None, "--vram", min=0, max=4096, help="VRAM floor per GPU, in GB")
CPUS_OPT = typer.Option(None, "--cpus", help="CPUs, e.g. 2 or 0.5")
MEMORY_OPT = typer.Option(None, "--memory", help="Memory, e.g. 8GiB or 512MiB")


def _fail(message: str) -> NoReturn:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


def resource_request(gpus: int | None, gpu_types: list[str] | None, vram: int | None,
                     cpus: float | None, memory: str | None) -> dict[str, Any] | None:
    """The API's ``resources`` from the flags; None when no flag is given, so the
    project's default applies. Bad values exit 1 with a message, not a traceback."""
    if gpus is None and not gpu_types and vram is None and cpus is None and memory is None:
        return None
    request: dict[str, Any] = {}
    if gpus is not None:
        request["gpus"] = gpus
    if gpu_types:
        for gpu_type in gpu_types:
            if not _GPU_TYPE.match(gpu_type):
                _fail(f"invalid --gpu-type {gpu_type!r}: expected a type as agents declare "
                      "it, e.g. A100-80GB")
        request["gpu_types"] = gpu_types
    if vram:
        request["vram_gb"] = vram
    if (gpu_types or vram) and not gpus:
        _fail("--gpu-type and --vram need --gpus 1 or more")
    if cpus is not None:
        if not math.isfinite(cpus) or not 0 <= cpus <= 1024:
            _fail(f"invalid --cpus {cpus}: expected a number of CPUs from 0 to 1024, e.g. 2")
        millicpus = round(cpus * 1000)
        if cpus > 0 and millicpus == 0:
            _fail(f"invalid --cpus {cpus}: the smallest request is 0.001")
        request["millicpus"] = millicpus
    if memory is not None:
        try:
            size = parse_size(memory, "--memory")
        except InvalidInput as exc:
            _fail(exc.detail)
        request["memory_mb"] = math.ceil(size / (1 << 20))
    return request


def gpu_summary(resources: dict[str, Any] | None) -> str:
    """A workspace's GPU request in a few characters: ``1x A100-80GB|H100-80GB``,
    ``2x any >=40GB``, or ``-`` for none."""
    if not resources or not resources.get("gpus"):
        return "-"
    types = "|".join(resources.get("gpu_types") or ()) or "any"
    floor = f" >={resources['vram_gb']}GB" if resources.get("vram_gb") else ""
    return f"{resources['gpus']}x {types}{floor}"


def resources_summary(resources: dict[str, Any] | None) -> str:
    """GPUs, CPUs and memory asked for, on one line."""
    parts = [f"gpus {gpu_summary(resources)}"]
    if resources and resources.get("millicpus"):
        parts.append(f"cpus {resources['millicpus'] / 1000:g}")
    if resources and resources.get("memory_mb"):
        parts.append(f"memory {format_size(int(resources['memory_mb']) << 20)}")
    return ", ".join(parts)


@app.command("create")
def create(name: str, wait: bool = WAIT_OPT, gpus: int | None = GPUS_OPT,
           gpu_type: list[str] | None = GPU_TYPE_OPT, vram: int | None = VRAM_OPT,
           cpus: float | None = CPUS_OPT, memory: str | None = MEMORY_OPT,
           url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Create a workspace (it starts running). With no resource flag it asks for the
    project's default; with any, for exactly what the flags say."""
    resources = resource_request(gpus, gpu_type, vram, cpus, memory)
    api = Api(url, token)
    started = time.monotonic()
    request: dict[str, Any] = {"name": name}
    if resources is not None:
        request["resources"] = resources
    body = api.json("POST", "/v1/workspaces", json=request,
                    headers={"Idempotency-Key": str(uuid.uuid4())})
    if wait:
        body = _wait(api, body["id"], "create", body, started)
    print_json(body)


@app.command("list")
def list_(as_json: bool = JSON_OPT, url: str | None = URL_OPT,
          token: str | None = TOKEN_OPT) -> None:
    """List workspaces (--json: every page's items as one {"items": [...]})."""
    api = Api(url, token)
    items: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        page = api.json("GET", "/v1/workspaces", params={"after": after} if after else {})
        items.extend(page["items"])
        after = page["next"]
        if not after:
            break
    if as_json:
        print_json({"items": items})
        return
    print_table(("id", "name", "state", "desired", "gpus", "updated"),
                [(ws["id"], ws["name"], ws["state"], ws["desired_state"],
                  gpu_summary(ws.get("resources")), when(ws["updated_at"])) for ws in items])
    for line in quota_lines(api.json("GET", "/v1/workspaces/quota")):
        err.print(line)  # stderr: stdout stays the table alone


def _of(used: int, limit: int | None) -> str:
    return f"{used}/{'unlimited' if limit is None else limit}"


def quota_lines(body: dict[str, Any]) -> list[str]:
    """``GET /v1/workspaces/quota`` (or an admin's quota read) in a line or two:
    the user's limits and usage, and the project's totals where any is set."""
    lines = []
    for scope in ("user", "project"):
        figures = body.get(scope)
        if not figures or not figures.get("usage"):
            continue  # a project without totals: nothing counted, nothing to show
        limits, usage = figures["limits"], figures["usage"]
        kernels = limits.get("kernels_per_workspace")
        lines.append(
            f"{'quota' if scope == 'user' else 'project quota'}: "
            f"{_of(usage['workspaces'], limits['workspaces'])} workspaces, "
            f"{_of(usage['running'], limits['running'])} running, "
            f"{_of(usage['gpus'], limits['gpus'])} GPUs, "
            f"{'unlimited' if kernels is None else kernels} kernels per workspace")
    return lines


@app.command("quota")
def quota(as_json: bool = JSON_OPT, url: str | None = URL_OPT,
          token: str | None = TOKEN_OPT) -> None:
    """Your workspace quota and what you hold (and your project's totals, if an admin
    set any). Over a limit, a create or resume is refused naming it."""
    body = Api(url, token).json("GET", "/v1/workspaces/quota")
    if as_json:
        print_json(body)
        return
    for line in quota_lines(body):
        typer.echo(line)


@app.command("get")
def get(workspace_id: str, as_json: bool = JSON_OPT, url: str | None = URL_OPT,
        token: str | None = TOKEN_OPT) -> None:
    """Show one workspace: JSON on stdout, and its resource request compactly on
    stderr (not with --json, whose output is the JSON alone)."""
    body = Api(url, token).json("GET", f"/v1/workspaces/{workspace_id}")
    print_json(body)
    if not as_json:
        err.print(f"resources: {resources_summary(body.get('resources'))}")


@app.command("suspend")
def suspend(workspace_id: str, wait: bool = WAIT_OPT, url: str | None = URL_OPT,
            token: str | None = TOKEN_OPT) -> None:
    """Suspend: release compute, keep files."""
    _change(Api(url, token), workspace_id, "suspend", wait)


@app.command("resume")
def resume(workspace_id: str, wait: bool = WAIT_OPT, url: str | None = URL_OPT,
           token: str | None = TOKEN_OPT) -> None:
    """Resume a suspended workspace."""
    _change(Api(url, token), workspace_id, "resume", wait)


@app.command("delete")
def delete(workspace_id: str, wait: bool = WAIT_OPT, url: str | None = URL_OPT,
           token: str | None = TOKEN_OPT) -> None:
    """Delete a workspace and its files."""
    _change(Api(url, token), workspace_id, "delete", wait)


@app.command("files")
def files(workspace_id: str, as_json: bool = JSON_OPT, url: str | None = URL_OPT,
          token: str | None = TOKEN_OPT) -> None:
    """List a workspace's files."""
    body = Api(url, token).json("GET", f"/v1/workspaces/{workspace_id}/files")
    if as_json:
        print_json(body)
        return
    print_table(("path", "size", "modified"),
                [(entry["path"], str(entry["size"]), when(entry["modified"]))
                 for entry in body["files"]],
                ids=("path",), right=("size",))


@app.command("put")
def put(workspace_id: str, local: Path, remote: str | None = typer.Argument(None),
        url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Upload a local file (notebooks are validated)."""
    if not local.is_file():
        raise typer.BadParameter(f"{local} is not a file")
    target = remote or local.name
    print_json(Api(url, token).json("PUT", f"/v1/workspaces/{workspace_id}/files/{target}",
                                    content=local.read_bytes()))


@app.command("cat")
def cat(workspace_id: str, path: str, url: str | None = URL_OPT,
        token: str | None = TOKEN_OPT) -> None:
    """Print a file."""
    response = Api(url, token).call("GET", f"/v1/workspaces/{workspace_id}/files/{path}")
    typer.echo(response.content, nl=False)


@app.command("rm")
def rm(workspace_id: str, path: str, url: str | None = URL_OPT,
       token: str | None = TOKEN_OPT) -> None:
    """Delete a file."""
    Api(url, token).call("DELETE", f"/v1/workspaces/{workspace_id}/files/{path}")


@app.command("gateway-url")
def gateway_url(workspace_id: str, url: str | None = URL_OPT,
                token: str | None = TOKEN_OPT) -> None:
    """Print the URL to give `jupyter server --gateway-url` for this workspace."""
    api = Api(url, token)
    api.json("GET", f"/v1/workspaces/{workspace_id}")
    typer.echo(f"{api.url}/v1/workspaces/{workspace_id}")  # plain: never wrapped


def has_display() -> bool:
    """Whether a browser could show a page here: macOS and Windows always can; elsewhere
    an X or Wayland display, or a $BROWSER command, is needed (not over plain ssh)."""
    if sys.platform in ("darwin", "win32"):
        return True
    return any(os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER"))


@app.command("open")
def open_(workspace_id: str,
          no_browser: bool = typer.Option(False, "--no-browser",
                                          help="Only print the URL; do not start a browser"),
          as_json: bool = typer.Option(False, "--json", help='Print {"url": ...} only'),
          url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Print the workspace's JupyterLab URL and open it in a browser (when there is a
    display). The workspace is looked up first, so a wrong id fails here, not in the
    browser."""
    api = Api(url, token)
    quoted = quote(workspace_id, safe="")  # an id, never a path of its own
    api.json("GET", f"/v1/workspaces/{quoted}",
             not_found=f"workspace {workspace_id} not found (or not visible with this token)")
    lab = f"{api.url}/w/{quoted}/lab"
    if as_json:
        print_json({"url": lab})
    else:
        typer.echo(lab)  # plain: a URL is never wrapped
    if no_browser or not has_display():
        return
    if not webbrowser.open(lab):
        err.print("no browser could be started; open the URL above yourself")
