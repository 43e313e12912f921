"""Running the control plane and agents under uvicorn, alone or together (embedded)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from nbfleet.agent.app import create_agent_app
from nbfleet.agent.service import AgentConfig, AgentService
from nbfleet.control.tenancy import write_secret


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to us, so several can share one loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_config(app: FastAPI, log_level: str, **kwargs: object) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=log_level,
        ws_per_message_deflate=False,  # compression costs more latency than it saves here
        access_log=log_level == "debug",
        lifespan="on",
        **kwargs,  # type: ignore[arg-type]
    )


def bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP must be explicit: asyncio only disables Nagle's algorithm on accepted
    # sockets whose proto says TCP, and with Nagle every cell paid a 40 ms delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def load_or_create_secret(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(32)
    write_secret(str(path), value)
    return value


@dataclass
class Serving:
    server: uvicorn.Server
    sock: socket.socket


def agent_server(config: AgentConfig, host: str, port: int, log_level: str) -> Serving:
    """Build the agent's server; exits with a message if its sandbox cannot run."""
    import typer
    from rich.console import Console

    from nbfleet.agent.sandbox import SandboxUnavailable

    try:
        service = AgentService(config)
    except SandboxUnavailable as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    if not config.advertise_url:
        config.advertise_url = f"http://{bound_host}:{bound_port}"
    app = create_agent_app(service)
    return Serving(_Server(uvicorn_config(app, log_level)), sock)


async def serve_all(servings: list[Serving]) -> None:
    """Start servers in order (each waits for the previous), stop them in reverse."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    try:
        for serving in servings:
            tasks.append(asyncio.create_task(serving.server.serve(sockets=[serving.sock])))
            while not serving.server.started:
                if tasks[-1].done():
                    await tasks[-1]  # surfaces the start-up error
                    raise SystemExit(1)
                await asyncio.sleep(0.05)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for serving, task in zip(reversed(servings), reversed(tasks), strict=False):
            serving.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
