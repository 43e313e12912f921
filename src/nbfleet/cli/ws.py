"""``nbfleet ws ...``: workspaces and their files."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nbfleet.cli.client import TOKEN_OPT, URL_OPT, Api, err, out, print_json

app = typer.Typer(help="Create, suspend, resume and delete workspaces; manage their files.",
                  no_args_is_help=True)

WAIT_OPT = typer.Option(False, "--wait", help="Wait until the workspace settles")


def _settled(body: dict[str, Any]) -> bool:
    return bool(body["state"] == body["desired_state"] or body["state"] == "failed")


#: How long one request may wait on the server before the CLI polls instead.
SERVER_WAIT_S = 50  # under the client's 60 s timeout


def _change(api: Api, workspace_id: str, verb: str, wait: bool) -> None:
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    if verb == "delete":
        body = api.json("DELETE", f"/v1/workspaces/{workspace_id}", headers=headers)
    else:
        params = {"wait": SERVER_WAIT_S} if wait else {}
        body = api.json("POST", f"/v1/workspaces/{workspace_id}/{verb}", headers=headers,
                        params=params)
    if wait and not _settled(body):
        body = api.wait_for(f"/v1/workspaces/{workspace_id}", _settled)
    print_json(body)
    if wait and verb == "resume":
        _tell_restored(body)


def _tell_restored(body: dict[str, Any]) -> None:
    """One line per kernel on stderr: what came back and what did not."""
    for kernel_id, report in ((body.get("restore") or {}).get("kernels") or {}).items():
        if report.get("files_only"):
            err.print(f"kernel {kernel_id}: files only ({report.get('error')})")
            continue
        lost = ", ".join(f"{x['name']} ({x['type']})" for x in report.get("lost", []))
        err.print(f"kernel {kernel_id} ({report.get('path')} start): restored "
                  f"{len(report.get('restored', []))} variables"
                  + (f", recomputed {', '.join(report['recomputed'])}"
                     if report.get("recomputed") else "")
                  + (f"; not restored: {lost}" if lost else ""))


@app.command("create")
def create(name: str, wait: bool = WAIT_OPT, url: str | None = URL_OPT,
           token: str | None = TOKEN_OPT) -> None:
    """Create a workspace (it starts running)."""
    api = Api(url, token)
    body = api.json("POST", "/v1/workspaces", json={"name": name},
                    headers={"Idempotency-Key": str(uuid.uuid4())})
    if wait:
        body = api.wait_for(f"/v1/workspaces/{body['id']}", _settled)
    print_json(body)


@app.command("list")
def list_(url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """List workspaces."""
    api = Api(url, token)
    table = Table("id", "name", "state", "desired", "updated")
    after: str | None = None
    while True:
        page = api.json("GET", "/v1/workspaces", params={"after": after} if after else {})
        for ws in page["items"]:
            table.add_row(ws["id"], ws["name"], ws["state"], ws["desired_state"], ws["updated_at"])
        after = page["next"]
        if not after:
            break
    out.print(table)


@app.command("get")
def get(workspace_id: str, url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Show one workspace."""
    print_json(Api(url, token).json("GET", f"/v1/workspaces/{workspace_id}"))


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
def files(workspace_id: str, url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """List a workspace's files."""
    body = Api(url, token).json("GET", f"/v1/workspaces/{workspace_id}/files")
    table = Table("path", "size", "modified")
    for entry in body["files"]:
        table.add_row(entry["path"], str(entry["size"]), entry["modified"] or "")
    out.print(table)


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
    out.print(f"{api.url}/v1/workspaces/{workspace_id}")
