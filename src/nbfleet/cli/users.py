"""``nbfleet user ...``: tenancy administration."""

from __future__ import annotations

import typer

from nbfleet.cli.client import TOKEN_OPT, URL_OPT, Api

app = typer.Typer(help="Manage users (needs an admin token).", no_args_is_help=True)


@app.command("create")
def create(
    name: str,
    org: str = typer.Option(..., "--org", help="Organisation (created if new)"),
    project: str = typer.Option(..., "--project", help="Project in the org (created if new)"),
    admin: bool = typer.Option(False, "--admin", help="Make the user a platform admin"),
    url: str | None = URL_OPT,
    token: str | None = TOKEN_OPT,
) -> None:
    """Create a user and print its API token (shown only once)."""
    body = Api(url, token).json(
        "POST", "/v1/admin/users",
        json={"name": name, "org": org, "project": project, "admin": admin},
    )
    typer.echo(body["token"])  # plain: a token is never wrapped or styled
