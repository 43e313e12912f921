"""``nbfleet admin ...``: operating the fleet (needs an admin token)."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from nbfleet.cli.client import JSON_OPT, TOKEN_OPT, URL_OPT, Api, out, print_json, print_table

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
