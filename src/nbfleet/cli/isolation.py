"""The agent's isolation options: limits per workspace, and how protections are told."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from nbfleet.agent.output import DEFAULT_OUTPUT_BUFFER, MIN_OUTPUT_BUFFER_BYTES
from nbfleet.model.errors import DomainError
from nbfleet.model.limits import Limits, format_size, parse_size

if TYPE_CHECKING:
    from nbfleet.agent.sandbox import Isolation

KERNEL_MEMORY_OPT = typer.Option(
    "4GiB", "--kernel-memory", help="Memory limit of each workspace's kernels (0: none)")
KERNEL_CPUS_OPT = typer.Option(
    "1", "--kernel-cpus", help="CPU limit of each workspace's kernels, in CPUs (0: none)")
KERNEL_PIDS_OPT = typer.Option(
    "512", "--kernel-pids", help="Process limit of each workspace's kernels (0: none)")
WORKSPACE_DISK_OPT = typer.Option(
    "10GiB", "--workspace-disk",
    help="Disk quota of each workspace (files, packages, /tmp), reserved on the host when "
         "the workspace starts; needs root (0: none)")
OUTPUT_BUFFER_OPT = typer.Option(
    DEFAULT_OUTPUT_BUFFER, "--output-buffer",
    help="Output kept per kernel, in this agent's memory, for the next client while none "
         "is connected (older output is dropped, and the client told); a connected client "
         "that falls twice this behind is disconnected")
CGROUP_PARENT_OPT = typer.Option(
    None, "--cgroup-parent",
    help="A cgroup subtree delegated to this agent (e.g. /nbfleet), for limits without root "
         "[default: below the agent's own cgroup]")


def limits_from(memory: str, cpus: str, pids: str, disk: str) -> Limits:
    """The limit flags, or exit 2 with what is wrong."""
    try:
        return Limits.parse(memory, cpus, pids, disk)
    except DomainError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {escape(exc.detail)}")
        raise typer.Exit(2) from exc


def output_buffer_from(value: str) -> int:
    """The ``--output-buffer`` flag in bytes, or exit 2 with what is wrong."""
    try:
        size = parse_size(value, "--output-buffer")
    except DomainError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {escape(exc.detail)}")
        raise typer.Exit(2) from exc
    if size < MIN_OUTPUT_BUFFER_BYTES:
        Console(stderr=True).print(f"[red]error:[/red] --output-buffer must be at least "
                                   f"{format_size(MIN_OUTPUT_BUFFER_BYTES)}")
        raise typer.Exit(2)
    return size


def print_protections(isolation: Isolation) -> None:
    """One line per protection: what is active on this host, and why any is not."""
    console = Console(stderr=True)
    console.print("[bold]kernel isolation on this host:[/bold]")
    for name, (active, detail) in isolation.report.items():
        mark = "[green]active [/green]" if active else "[yellow]missing[/yellow]"
        console.print(f"  {mark} {name:<8} {escape(detail)}")
