"""Validating and preparing what ``nbfleet up``, ``control`` and ``agent`` start.

The server commands in :mod:`nbfleet.cli.main` share these steps: check option
values, make the process and its state directory owner-only, find the cluster
secret, bind the listening socket and build the control plane's server. Each
failure ends the command with one line on stderr and exit status 2. The server
stack is imported inside the functions only, so client commands stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.panel import Panel

from nbfleet.cli.home import sqlite_url
from nbfleet.model.errors import DomainError
from nbfleet.model.resources import parse_gpu_spec

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from pathlib import Path

    from nbfleet.cli.servers import Serving

console = Console(stderr=True)


def port_opt(default: int, help_text: str = "Port to listen on") -> Any:
    """A port as text, so that a bad one gets the same one-line error as a busy one."""
    return typer.Option(str(default), "--port", metavar="PORT", help=help_text)


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2, the servers' answer to a bad start."""
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def private_process() -> str | None:
    """First thing in every server command: owner-only file modes from now on, and
    NBFLEET_CLUSTER_SECRET taken out of the environment (returned), so no kernel,
    job or other child inherits it."""
    from nbfleet.cli.cluster_secret import take_from_env
    from nbfleet.cli.owner_only import restrict_umask

    restrict_umask()
    return take_from_env()


def listen(host: str, port: str) -> socket.socket:
    from nbfleet.cli.listen import ListenError, bind, parse_port

    try:
        return bind(host, parse_port(port))
    except ListenError as exc:
        fail(str(exc))


def explicit_secret(secret_file: str | None, from_env: str | None) -> str | None:
    from nbfleet.cli.cluster_secret import SecretError, explicit

    try:
        return explicit(secret_file, from_env)
    except SecretError as exc:
        fail(str(exc))


def private_home(home: Path, create: bool = True) -> None:
    from nbfleet.cli.owner_only import secure_home

    try:
        secure_home(home, create)
    except OSError as exc:
        fail(f"cannot use {home} as the state directory: {exc.strerror or exc}")


def home_secret(home: Path, create: bool) -> str:
    from nbfleet.cli.cluster_secret import SecretError, from_home

    try:
        return from_home(home, create)
    except SecretError as exc:
        fail(str(exc))


def job_options(tiers: str, prices: str, heartbeat_timeout: float, grace: float,
                 retention: float, backoff: float, interval: float) -> dict[str, Any]:
    """The job settings for ControlConfig; exits with a message if one is invalid."""
    from nbfleet.control.platform import ControlConfig

    options: dict[str, Any] = {"job_tiers": tiers, "gpu_prices": prices,
               "job_heartbeat_timeout_s": heartbeat_timeout, "job_kill_grace_s": grace,
               "job_result_retention_s": retention, "job_backoff_base_s": backoff,
               "job_dispatch_interval_s": interval}
    try:
        ControlConfig(db_url="", blobs_url="", secret="", **options).job_settings()
    except DomainError as exc:
        console.print(f"[red]error:[/red] {exc.detail}")
        raise typer.Exit(2) from exc
    return options


def check_agent_options(gpus: str, sandbox: str) -> None:
    from nbfleet.agent.sandbox import MODES

    try:
        parse_gpu_spec(gpus)
    except DomainError as exc:
        console.print(f"[red]error:[/red] {exc.detail}")
        raise typer.Exit(2) from exc
    if sandbox not in MODES:
        console.print(f"[red]error:[/red] --sandbox must be one of {', '.join(MODES)}")
        raise typer.Exit(2)


def check_suspend_options(on_busy: str) -> None:
    if on_busy not in ("wait", "interrupt"):
        console.print("[red]error:[/red] --suspend-on-busy must be 'wait' or 'interrupt'")
        raise typer.Exit(2)


def check_rate_limit_options(rate: str, storage: str) -> None:
    from rich.markup import escape

    from nbfleet.web.ratelimit import ApiRateLimit, parse_rate

    option = "--rate-limit"
    try:
        items = parse_rate(rate)
        option = "--rate-limit-storage"
        if items:
            ApiRateLimit(items, storage)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {option}: {escape(str(exc))}")
        raise typer.Exit(2) from exc


def check_blobs(url: str) -> None:
    """Refuse to start on a blob store that cannot be used: a URL that is neither a
    directory nor ``s3://bucket[/prefix]``, a directory that cannot be made, no such
    bucket, credentials refused or missing, an endpoint that does not answer. One
    line now, not a traceback at the first file write or suspend. S3 credentials
    come from the environment or ``~/.aws``, as botocore reads them, never from an
    option."""
    from nbfleet.storage.blobs import BlobStore, BlobStoreUnusable

    try:
        BlobStore(url).check()
    except BlobStoreUnusable as exc:
        fail(f"--blobs: {exc}")
    except (ValueError, OSError) as exc:
        fail(f"--blobs: cannot use {url}: {exc}")


def control_server(home: Path, db: str | None, blobs: str | None, secret: str,
             sock: socket.socket, log_level: str, lifecycle: dict[str, Any]
             ) -> tuple[Serving, str, str, Callable[[], Serving]]:
    """The control plane's server (migrated DB, admin token) on ``sock``, its URL,
    the admin token, and a factory for more servers on the same socket (workers)."""
    blobs = blobs or str(home / "blobs")
    check_blobs(blobs)  # before the server stack's imports: a bad store fails fast
    from nbfleet.cli.listen import url_of
    from nbfleet.cli.owner_only import secure_sqlite
    from nbfleet.cli.servers import Serving, _Server, uvicorn_config
    from nbfleet.control.app import create_app
    from nbfleet.control.platform import ControlConfig
    from nbfleet.control.tenancy import ensure_admin, write_secret

    url = url_of(sock)
    config = ControlConfig(db_url=db or sqlite_url(home), blobs_url=blobs,
                           secret=secret, control_url=url, home_dir=str(home), **lifecycle)
    secure_sqlite(config.db_url)  # one outside the home, left by an older version
    control_app = create_app(config)
    token = ensure_admin(control_app.state.platform.db, str(home / "admin-token"))
    write_secret(str(home / "url"), url)

    def another() -> Serving:
        return Serving(_Server(uvicorn_config(create_app(config), log_level)), sock,
                       name="control plane")

    return (Serving(_Server(uvicorn_config(control_app, log_level)), sock,
                    name="control plane"), url, token, another)


def banner(url: str, token: str, home: Path) -> None:
    console.print(Panel.fit(
        f"[bold]nbfleet[/bold] is up at [cyan]{url}[/cyan]\n"
        f"admin token: [yellow]{token}[/yellow]  (also in {home / 'admin-token'}, mode 0600)\n"
        f"dashboard:   {url}/  (sign in with a token; each workspace opens in JupyterLab)\n"
        f"API docs:    {url}/docs\n"
        "Press Ctrl-C to stop.",
        title="nbfleet",
    ))
