"""The CLI's HTTP client: finds the platform, sends the token, explains errors."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import typer
from rich.console import Console

from nbfleet.cli.home import home_dir

err = Console(stderr=True)
out = Console()


class Api:
    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        home = home_dir()
        self.url = (url or os.environ.get("NBFLEET_URL") or _read(home / "url")
                    or "http://127.0.0.1:8765").rstrip("/")
        self.token = token or os.environ.get("NBFLEET_TOKEN") or _read(home / "admin-token")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.ConnectError:
            err.print(f"[red]error:[/red] cannot reach nbfleet at {self.url}; "
                      "is `nbfleet up` running?")
            raise typer.Exit(1) from None
        if response.status_code >= 400:
            err.print(f"[red]error {response.status_code}:[/red] {_problem_detail(response)}")
            raise typer.Exit(1)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.call(method, path, **kwargs)
        return response.json() if response.content else None

    def wait_for(self, path: str, done: Callable[[dict[str, Any]], bool],
                 timeout_s: float = 120.0,
                 describe: Callable[[dict[str, Any]], str] | None = None,
                 give_up: bool = True) -> dict[str, Any]:
        """Poll a resource with a spinner until ``done`` says so.

        On timeout: an error and exit 1, or with ``give_up=False`` the last body
        (the caller then says truthfully where things stand).
        """
        deadline = time.monotonic() + timeout_s
        with err.status("waiting...") as status:
            while True:
                body: dict[str, Any] = self.json("GET", path)
                status.update(describe(body) if describe else f"state: {body.get('state')}")
                if done(body):
                    return body
                if time.monotonic() > deadline:
                    if not give_up:
                        return body
                    err.print(f"[red]error:[/red] gave up after {timeout_s:.0f}s "
                              f"(state {body.get('state')})")
                    raise typer.Exit(1)
                time.sleep(0.2)


def _read(path: Any) -> str | None:
    try:
        return str(path.read_text().strip()) or None
    except OSError:
        return None


def _problem_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    return str(body.get("detail") or body.get("title") or body)


def print_json(value: Any) -> None:
    out.print_json(json.dumps(value))


URL_OPT = typer.Option(None, "--url", envvar="NBFLEET_URL", help="Control plane URL")
TOKEN_OPT = typer.Option(None, "--token", envvar="NBFLEET_TOKEN", help="API token")
