"""The CLI's HTTP client: finds the platform, sends the token, explains errors."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NoReturn

import httpx
import typer
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.segment import Segments
from rich.table import Table
from rich.text import Text

from nbfleet.cli.home import DEFAULT_PORT, home_dir

err = Console(stderr=True)
out = Console()


DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
#: Seconds a request may take; the CLI's waits ask the server for less.
TIMEOUT_S = 60.0


def choose_url(url: str | None) -> tuple[str, str]:
    """The control plane's URL and how it was chosen, for an error to name both:
    ``--url``, else ``$NBFLEET_URL``, else the ``url`` file that ``nbfleet up`` writes
    in ``$NBFLEET_HOME``, else the default."""
    env = os.environ.get("NBFLEET_URL")
    if url:  # typer fills --url from NBFLEET_URL too
        return url, "from NBFLEET_URL" if url == env else "from --url"
    if env:
        return env, "from NBFLEET_URL"
    home = home_dir()
    where = (f"NBFLEET_HOME={os.environ['NBFLEET_HOME']}" if os.environ.get("NBFLEET_HOME")
             else "NBFLEET_HOME unset, so ./.nbfleet")
    saved = _read(home / "url")
    if saved:
        return saved, f"from {home / 'url'}, which `nbfleet up` wrote ({where})"
    return DEFAULT_URL, (f"the default: no --url, no NBFLEET_URL, and no url file in "
                         f"{home} ({where})")


class Api:
    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        home = home_dir()
        chosen, self.url_source = choose_url(url)
        self.url = chosen.rstrip("/")
        self.token = token or os.environ.get("NBFLEET_TOKEN") or _read(home / "admin-token")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            self.http = httpx.Client(base_url=self.url, headers=headers, timeout=TIMEOUT_S)
        except httpx.InvalidURL as exc:
            self.unreachable(exc)

    def unreachable(self, exc: Exception) -> NoReturn:
        """Exit 1 saying which URL was tried, how it was chosen, and how to choose
        another: the usual cause is a CLI pointed at the wrong place, not a bug."""
        if isinstance(exc, httpx.TimeoutException):
            why = f"no answer within {TIMEOUT_S:.0f} s"
        else:
            why = str(exc) or type(exc).__name__
        err.print(f"[red]error:[/red] cannot reach nbfleet at {escape(self.url)} "
                  f"({escape(why)})", soft_wrap=True)
        err.print(f"  that URL is {escape(self.url_source)}", soft_wrap=True)
        err.print("  start the platform with `nbfleet up`, or point the CLI at a running one: "
                  "--url or NBFLEET_URL, or NBFLEET_HOME set to the home of `nbfleet up` "
                  "(it writes the URL and the admin token there)", soft_wrap=True)
        raise typer.Exit(1)

    def call(self, method: str, path: str, *, not_found: str | None = None,
             **kwargs: Any) -> httpx.Response:
        """The answer, or exit 1 saying what went wrong; ``not_found`` is what a 404
        means here (a path that is not even a route answers a bare "Not Found")."""
        try:
            response = self.http.request(method, path, **kwargs)
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            self.unreachable(exc)
        if response.status_code == 404 and not_found:
            err.print(f"[red]error:[/red] {escape(not_found)}", soft_wrap=True)
            raise typer.Exit(1)
        if response.status_code >= 400:
            err.print(f"[red]error {response.status_code}:[/red] "
                      f"{escape(_problem_detail(response))}", soft_wrap=True)
            raise typer.Exit(1)
        return response

    def json(self, method: str, path: str, *, not_found: str | None = None,
             **kwargs: Any) -> Any:
        response = self.call(method, path, not_found=not_found, **kwargs)
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


def when(moment: str | None) -> str:
    """An API time (RFC 3339, UTC) for a table: to the second, with a space that a
    narrow column can wrap at. ``--json`` keeps the exact value."""
    if not moment:
        return ""
    date, sep, clock = moment.partition("T")
    if not sep or not moment.endswith("Z"):  # not the API's form: shown as it came
        return moment
    return f"{date} {clock.split('.', 1)[0].removesuffix('Z')}Z"


def print_table(headers: Sequence[str], rows: Iterable[Sequence[str | None]], *,
                ids: Collection[str] = ("id",), right: Collection[str] = (),
                title: str | None = None) -> None:
    """A table whose ``ids`` columns are never cut: ids are for copying, so each is
    kept whole on one line, and the other columns wrap (folding long words) in the
    room left. The usual boxed table when that room holds every header; on a narrower
    terminal a borderless one (two spaces between columns); narrower still, lines run
    past the edge rather than lose characters. Cells are plain text, never rich
    markup (names are the users')."""
    cells = [[Text(value or "") for value in row] for row in rows]
    count = len(headers)
    natural = [max([len(header), *(row[index].cell_len for row in cells)])
               for index, header in enumerate(headers)]
    least = [natural[index] if header in ids else max(len(word) for word in header.split())
             for index, header in enumerate(headers)]
    boxed = sum(least) + 3 * count + 1 <= out.width
    overhead = 3 * count + 1 if boxed else 2 * (count - 1)
    widths = _share(natural, least, out.width - overhead)
    table = Table(title=title) if boxed else Table(title=title, box=None, pad_edge=False)
    for header, width in zip(headers, widths, strict=True):
        justify: JustifyMethod = "right" if header in right else "left"
        table.add_column(header, justify=justify, width=width, no_wrap=header in ids,
                         overflow="fold")
    for row in cells:
        table.add_row(*row)
    # Rendered at its own width, which may exceed the terminal's: print() would
    # squeeze it back to the terminal's width and cut the ids.
    width = max(out.width, sum(widths) + overhead)
    lines = out.render_lines(table, out.options.update_width(width), new_lines=True)
    out.print(Segments([segment for line in lines for segment in line]), soft_wrap=True,
              end="")


def _share(natural: list[int], least: list[int], room: int) -> list[int]:
    """Column widths: each at least ``least``, growing towards ``natural`` within
    ``room``; the columns that need least extra are served first, so short values
    (states, counts) stay on one line and long ones wrap."""
    widths = list(least)
    spare = room - sum(widths)
    order = sorted(range(len(widths)), key=lambda index: natural[index] - least[index])
    for position, index in enumerate(order):
        if spare <= 0:
            break
        grow = min(natural[index] - widths[index], spare // (len(order) - position))
        widths[index] += grow
        spare -= grow
    return widths


URL_OPT = typer.Option(None, "--url", envvar="NBFLEET_URL",
                       help="Control plane URL [default: NBFLEET_HOME's url file, else "
                            f"{DEFAULT_URL}]")
TOKEN_OPT = typer.Option(None, "--token", envvar="NBFLEET_TOKEN", help="API token")
JSON_OPT = typer.Option(False, "--json", help="Print the API's JSON instead of a table")
#: For commands whose output is the API's JSON anyway: scripts may pass --json to any
#: list or get command without knowing which ones print tables.
JSON_ALWAYS_OPT = typer.Option(False, "--json",
                               help="Print the API's JSON (this command always does)")
