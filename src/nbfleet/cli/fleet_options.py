"""The GPU scheduler's options, shared by ``nbfleet up`` and ``nbfleet control``."""

from __future__ import annotations

import shlex
from typing import Any

import typer
from rich.console import Console

from nbfleet.control.fleet.sizing import FleetSettings
from nbfleet.model.errors import DomainError
from nbfleet.model.resources import parse_gpu_spec
from nbfleet.policy.scheduling.registry import POLICIES

POLICY_OPT = typer.Option(
    "nbfleet", "--policy",
    help="GPU scheduling policy for GPU workspaces, the same code `nbfleet sim` runs: "
         f"{', '.join(POLICIES)} (docs/decisions.md says why nbfleet is the default)")
HOST_GPUS_OPT = typer.Option(
    "", "--host-gpus", metavar="SPEC",
    help="GPUs of a host the autoscaler adds, as an agent's --gpus (e.g. 1xA100-80GB); "
         "default: the largest registered host")
MAX_HOSTS_OPT = typer.Option(
    0, "--max-hosts", min=0, max=10_000,
    help="Hosts the autoscaler may run (0: it adds none; the fleet is the agents that join)")
REPLICAS_OPT = typer.Option(
    0, "--replicas", min=0, max=16,
    help="Replicas per GPU kernel (0: the policy's own, at most the hosts the fleet may have)")
METER_INTERVAL_OPT = typer.Option(
    15.0, "--meter-interval", min=0.1, max=3600,
    help="Seconds between usage reports of running GPU cells and standby replicas "
         "(each renews its credit hold's lease)")
AUTOSCALE_INTERVAL_OPT = typer.Option(
    60.0, "--autoscale-interval", min=0.1, max=86400,
    help="Seconds between the autoscaler's passes (scale-out for waiting work is at once)")
SCALE_IN_DELAY_OPT = typer.Option(
    600.0, "--scale-in-delay", min=0, max=86400,
    help="Seconds after a scale-out before an idle host may be scaled in")
PREWARM_OPT = typer.Option(
    -1, "--prewarm", min=-1, max=64,
    help="Warm kernels the GPU scheduler keeps on each host, through the agents' warm "
         "pools (-1: the policy's own, 1 for notebookos, nbfleet and lcp; 0: none)")
HOST_AGENT_ARGS_OPT = typer.Option(
    "", "--host-agent-args", metavar="ARGS",
    help="Extra `nbfleet agent` options for the hosts the autoscaler starts on this "
         "machine, e.g. '--warm-pool 1 --workspace-disk 2GiB'")


def fleet_options(policy: str, host_gpus: str, max_hosts: int, replicas: int,
                  meter_interval: float, autoscale_interval: float, scale_in_delay: float,
                  prewarm: int, host_agent_args: str, console: Console) -> dict[str, Any]:
    """ControlConfig fields; exits with a message (status 2) if one is invalid."""
    if policy not in POLICIES:
        console.print(f"[red]error:[/red] --policy must be one of {', '.join(POLICIES)}")
        raise typer.Exit(2)
    try:
        groups = parse_gpu_spec(host_gpus)
    except DomainError as exc:
        console.print(f"[red]error:[/red] --host-gpus: {exc.detail}")
        raise typer.Exit(2) from exc
    if host_gpus and not groups:
        console.print("[red]error:[/red] --host-gpus declares no GPUs")
        raise typer.Exit(2)
    try:
        shlex.split(host_agent_args)
    except ValueError as exc:
        console.print(f"[red]error:[/red] --host-agent-args: {exc}")
        raise typer.Exit(2) from exc
    if max_hosts and not host_gpus:
        console.print("[red]error:[/red] --max-hosts needs --host-gpus: what a host it adds "
                      "declares (e.g. 1xA100-80GB)")
        raise typer.Exit(2)
    fleet = FleetSettings(policy=policy, host_gpus=host_gpus, max_hosts=max_hosts,
                          replicas=replicas, autoscale_interval_s=autoscale_interval,
                          scale_in_delay_s=scale_in_delay, prewarm=prewarm)
    return {"fleet": fleet, "meter_interval_s": meter_interval,
            "host_agent_args": host_agent_args}
