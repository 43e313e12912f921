"""``nbfleet admin ...``: operating the fleet (needs an admin token)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from nbfleet.cli.client import (
    JSON_OPT,
    TOKEN_OPT,
    URL_OPT,
    Api,
    err,
    out,
    print_json,
    print_table,
)
from nbfleet.cli.ws import quota_lines

app = typer.Typer(help="Operate the fleet (needs an admin token).", no_args_is_help=True)


@app.command("fleet")
def fleet(
    as_json: bool = JSON_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Hosts with their GPUs (total, subscribed, committed, by type), subscription
    ratio, warm pool, and the cells waiting for GPUs."""
    body: dict[str, Any] = Api(url, token).json("GET", "/v1/admin/fleet")
    if as_json:
        print_json(body)
        return
    totals = body["totals"]
    out.print(f"policy [bold]{escape(body['policy'])}[/bold] "
              f"({body['replicas']} replicas per kernel): "
              f"{totals['hosts']} hosts (+{totals['provisioning']} being added), "
              f"{totals['committed_gpus']}/{totals['gpus']} GPUs committed, "
              f"{totals['subscribed_gpus']} subscribed, SR {totals['subscription_ratio']:.2f}")
    rows = []
    for host in body["hosts"]:
        gpus = host["gpus"]
        kinds = ", ".join(f"{row['committed']}/{row['total']} {kind}"
                          for kind, row in sorted(gpus["by_type"].items())) or "none"
        rows.append((host["id"], kinds, str(gpus["subscribed"]), str(gpus["committed"]),
                     f"{host['subscription_ratio']:.2f}", str(host["warm"]),
                     str(len(host["kernels"]))))
    print_table(("host", "GPUs by type", "subscribed", "committed", "SR", "warm", "kernels"),
                rows, ids=("host",))
    if body["queue"]:
        print_table(("waiting cell", "workspace", "GPUs", "waited", "why"),
                    [(cell["cell"], cell["workspace_id"], str(cell["gpus"]),
                      f"{cell['waited_s']:.1f} s", cell["reason"])
                     for cell in body["queue"]],
                    ids=("waiting cell", "workspace"))
    else:
        out.print("no cell is waiting for GPUs")


def _host_path(host: str) -> str:
    return f"/v1/admin/hosts/{quote(host, safe='')}"


@app.command("drain")
def drain(
    host: str = typer.Argument(..., help="The host's (agent's) id, as `nbfleet admin fleet` "
                                         "lists it"),
    wait: bool = typer.Option(True, "--wait/--no-wait",
                              help="Wait until no workspace is left on the host"),
    timeout: float = typer.Option(600.0, "--timeout", min=1,
                                  help="Seconds to wait before giving up (exit 1)"),
    as_json: bool = JSON_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Drain a host so it can be stopped and upgraded: it gets no new workspaces,
    and each one on it is moved with its state (variables, files) to another host,
    or suspended when there is none. Undo with `nbfleet admin undrain HOST`."""
    api = Api(url, token)
    path = _host_path(host)
    body: dict[str, Any] = api.json("POST", f"{path}/drain", not_found=f"no host {host!r}")
    if wait:
        body = _wait_empty(api, path, body, timeout)
    if as_json:
        print_json(body)
        return
    if body["workspaces"]:
        out.print(f"host {escape(host)} is draining: {body['workspaces']} workspaces left "
                  f"(moved {body['moved']}, suspended {body['suspended']} so far)")
        return
    out.print(f"host {escape(host)} is drained: moved {body['moved']}, suspended "
              f"{body['suspended']}; it can be stopped")


def _wait_empty(api: Api, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Poll the host with a progress bar of the workspaces still on it, until none."""
    start = max(int(body["workspaces"]), 1)
    deadline = time.monotonic() + timeout
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
               TextColumn("{task.fields[left]} left"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(f"draining {escape(body['id'])}", total=start,
                                 left=body["workspaces"])
        while body["workspaces"] > 0:
            if time.monotonic() > deadline:
                progress.stop()
                err.print(f"[red]error:[/red] host {escape(body['id'])} still has "
                          f"{body['workspaces']} workspaces after {timeout:.0f} s; it is "
                          "still draining (run the command again to keep waiting)",
                          soft_wrap=True)
                raise typer.Exit(1)
            time.sleep(0.3)
            body = api.json("GET", path, not_found=f"no host {body['id']!r}")
            start = max(start, int(body["workspaces"]))
            progress.update(task, total=start, completed=start - body["workspaces"],
                            left=body["workspaces"])
    return body


@app.command("undrain")
def undrain(
    host: str = typer.Argument(..., help="The host's (agent's) id"),
    as_json: bool = JSON_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Stop draining a host: it takes new workspaces again (those moved away stay
    where they went)."""
    body: dict[str, Any] = Api(url, token).json(
        "DELETE", f"{_host_path(host)}/drain", not_found=f"no host {host!r}")
    if as_json:
        print_json(body)
        return
    out.print(f"host {escape(host)} takes work again ({body['workspaces']} workspaces on it)")


_LIMIT_HELP = "a number, 'unlimited', or 'default' (inherit)"


def _limit(value: str | None, flag: str) -> int | str | None:
    """A flag's limit: None (flag not given), ``"default"``, ``"unlimited"`` or N."""
    if value is None or value in ("default", "unlimited"):
        return value
    if not value.isdigit():
        err.print(f"[red]error:[/red] invalid {flag} {value!r}: {_LIMIT_HELP}")
        raise typer.Exit(1)
    return int(value)


def _merged(stored: dict[str, Any] | None, changes: dict[str, int | str | None]
            ) -> dict[str, Any]:
    """The stored override with the flags given applied (``default`` clears one)."""
    merged = dict(stored or {})
    for name, value in changes.items():
        if value == "default":
            merged.pop(name, None)
        elif value is not None:
            merged[name] = value
    return merged


@app.command("quota")
def quota(
    org: str = typer.Option(..., "--org", help="The organisation"),
    project: str | None = typer.Option(None, "--project", help="A project of the org"),
    user: str | None = typer.Option(None, "--user", help="A user of the org"),
    per_user: bool = typer.Option(False, "--per-user", help="With --project: set what each "
                                  "of its users may hold, not the project's totals"),
    workspaces: str | None = typer.Option(None, "--workspaces", help=_LIMIT_HELP),
    running: str | None = typer.Option(None, "--running", help=_LIMIT_HELP),
    kernels: str | None = typer.Option(None, "--kernels", help="Kernels per workspace: "
                                       + _LIMIT_HELP),
    gpus: str | None = typer.Option(None, "--gpus", help=_LIMIT_HELP),
    as_json: bool = JSON_OPT,
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Show or set workspace quotas of a project (--project) or a user (--user).
    Without a limit flag it shows them; flags change only the limits they name.
    Defaults: each user 20 workspaces, 10 running, 8 kernels per workspace; GPUs
    and project totals unlimited."""
    if (project is None) == (user is None):
        err.print("[red]error:[/red] give exactly one of --project and --user")
        raise typer.Exit(1)
    changes = {"workspaces": _limit(workspaces, "--workspaces"),
               "running": _limit(running, "--running"),
               "kernels_per_workspace": _limit(kernels, "--kernels"),
               "gpus": _limit(gpus, "--gpus")}
    api = Api(url, token)
    if user is not None:
        path = f"/v1/admin/orgs/{quote(org, safe='')}/users/{quote(user, safe='')}/quota"
    else:
        path = (f"/v1/admin/orgs/{quote(org, safe='')}/projects/"
                f"{quote(project or '', safe='')}/quota")
    body: dict[str, Any] = api.json(
        "GET", path, not_found=f"no {'user' if user else 'project'} {org}/{user or project}")
    if any(value is not None for value in changes.values()):
        stored = body["set"]
        if user is not None:
            request: dict[str, Any] = _merged(stored, changes)
        else:
            scope = "per_user" if per_user else "project"
            request = {**stored, scope: _merged(stored.get(scope), changes)}
        body = api.json("PUT", path, json=request)
    if as_json:
        print_json(body)
        return
    for line in quota_lines(body):
        out.print(escape(line))
    if "per_user" in body:
        limits = body["per_user"]["limits"]
        out.print("each user: " + ", ".join(
            f"{name} {'unlimited' if value is None else value}"
            for name, value in limits.items()))
