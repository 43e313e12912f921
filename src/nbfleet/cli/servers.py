"""Running the control plane and agents under uvicorn, alone or together (embedded)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import uvicorn
from fastapi import FastAPI

from nbfleet.agent.app import create_agent_app
from nbfleet.agent.service import AgentConfig, AgentService
from nbfleet.cli.listen import url_of
from nbfleet.web.browser import redact_server_logs


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to us, so several can share one loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn ends a failed start-up with ``sys.exit``: raised inside a task,
        SystemExit escapes the event loop itself, which then never stops anyio's
        worker threads, and the process hangs on exit with its port still open.
        Here a failed start-up only ends this server; :func:`serve_all` says why."""
        try:
            await super().startup(sockets)
        except SystemExit:
            self.should_exit = True


#: How long an idle keep-alive connection stays open. Longer than the clients' own
#: expiry (httpx: 5 s, uvicorn's default here too) and a load balancer's idle timeout
#: (AWS ALB: 60 s), so that the client, never the server, closes it: when both gave up
#: at 5 s, a request sent on a connection the server was closing met ECONNRESET.
KEEP_ALIVE_S = 65


def uvicorn_config(app: FastAPI, log_level: str, **kwargs: object) -> uvicorn.Config:
    """uvicorn's settings; its logs never show a credential from a URL (``?token=``,
    a channel ticket: ``web.browser.redact_server_logs``)."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_keep_alive=KEEP_ALIVE_S,
        ws_per_message_deflate=False,  # compression costs more latency than it saves here
        access_log=log_level == "debug",
        lifespan="on",
        **kwargs,  # type: ignore[arg-type]
    )
    redact_server_logs()  # after Config, which (re)configures uvicorn's loggers
    return config


class StartupFailed(RuntimeError):
    """A server's start-up raised: the process must exit, not go on holding a port
    that nothing answers."""


@dataclass
class Serving:
    server: uvicorn.Server
    sock: socket.socket
    #: Run at the first SIGTERM/SIGINT before the server stops (an agent's drain);
    #: a second signal cuts it short.
    before_stop: Callable[[], Coroutine[Any, Any, None]] | None = None
    name: str = "server"
    #: Why its start-up failed (uvicorn logs the traceback and keeps only a flag).
    startup_error: str | None = None

    def __post_init__(self) -> None:
        app = cast(FastAPI, self.server.config.app)
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def noting_failure(app_: Any) -> AsyncIterator[Any]:
            started = False
            try:
                async with inner(app_) as state:
                    started = True
                    yield state
            except Exception as exc:
                if not started:
                    self.startup_error = f"{type(exc).__name__}: {exc}"
                raise

        app.router.lifespan_context = noting_failure


def agent_server(config: AgentConfig, sock: socket.socket, log_level: str,
                 drain_on_stop: bool = False) -> Serving:
    """Build the agent's server on ``sock``; exits with a message if its sandbox
    cannot run. ``drain_on_stop``: a stand-alone agent drains itself on SIGTERM
    (in embedded mode the control plane stops with it, so there is nowhere to go)."""
    import typer
    from rich.console import Console

    from nbfleet.agent.sandbox import SandboxUnavailable
    from nbfleet.cli.isolation import print_protections

    try:
        service = AgentService(config)
    except SandboxUnavailable as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    print_protections(service.isolation)
    if not config.advertise_url:
        config.advertise_url = url_of(sock)
    app = create_agent_app(service)
    return Serving(_Server(uvicorn_config(app, log_level)), sock,
                   service.drain if drain_on_stop else None, name="agent")


def run_fast(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop (which uvicorn[standard] brings) where it is there.

    The control plane alone spends most of its HTTP time in the event loop's own
    transports; uvloop's, written in C, cost a fraction of asyncio's. Processes
    that host kernels and jobs (``agent``, ``up``) stay on asyncio's loop, which
    their ZeroMQ relays and subprocess handling are tested on.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def release_db(serving: Serving) -> None:
    """Close a control-plane server's pooled DB connections (before forking)."""
    app = cast(FastAPI, serving.server.config.app)
    app.state.platform.db.dispose()


def serve_forked(build: Callable[[], Serving], workers: int) -> None:
    """Serve from ``workers`` forked processes, each running ``build()`` (a whole
    control-plane replica with its own event loop and connection pool) on the one
    listening socket they inherit: the kernel spreads connections among them, so a
    host's cores are all used. A worker that dies is replaced; SIGTERM or SIGINT
    stops them all. Blocks until they have exited."""
    log = logging.getLogger("nbfleet.workers")
    children: set[int] = set()
    stopping = False

    def spawn() -> None:
        pid = os.fork()
        if pid:
            children.add(pid)
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        code = 0
        try:
            run_fast(serve_all([build()]))
        except BaseException:
            log.exception("control-plane worker %d failed", os.getpid())
            code = 1
        os._exit(code)

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for _ in range(workers):
        spawn()
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return
        children.discard(pid)
        if not stopping:
            log.warning("control-plane worker %d exited (status %d); starting another",
                        pid, status)
            time.sleep(1.0)
            spawn()


def run_servers(servings: list[Serving], fast: bool = False) -> None:
    """Serve until stopped (``fast``: on uvloop, see :func:`run_fast`); a start-up
    that fails ends the process with status 1 and the reason on stderr."""
    import typer
    from rich.console import Console

    try:
        if fast:
            run_fast(serve_all(servings))
        else:
            asyncio.run(serve_all(servings))
    except StartupFailed as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc


#: Threads for blocking calls (``asyncio.to_thread``): DB transactions, blob and file
#: copies, slot set-up. They mostly wait (on disk, on SQLite's write lock), so the
#: default (CPUs + 4) let a burst of 32 resumes queue behind each other's waits.
BLOCKING_THREADS = 64


async def serve_all(servings: list[Serving]) -> None:
    """Start servers in order (each waits for the previous), stop them in reverse."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(BLOCKING_THREADS, "nbfleet-blocking"))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    try:
        for serving in servings:
            tasks.append(asyncio.create_task(serving.server.serve(sockets=[serving.sock])))
            while not serving.server.started:
                if tasks[-1].done():
                    await tasks[-1]  # surfaces an error uvicorn did not catch
                    # A plain exception, not SystemExit: the loop then ends as usual,
                    # so its worker threads stop and the process can exit.
                    raise StartupFailed(f"the {serving.name} could not start: "
                                        f"{serving.startup_error or 'see the log above'}")
                await asyncio.sleep(0.05)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            await _before_stop(servings, stop)
    finally:
        for serving, task in zip(reversed(servings), reversed(tasks), strict=False):
            serving.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _before_stop(servings: list[Serving], stop: asyncio.Event) -> None:
    """Run the servers' ``before_stop`` hooks (while they keep serving), unless a
    second signal comes first."""
    hooks = [s.before_stop() for s in servings if s.before_stop is not None]
    if not hooks:
        return

    async def run_hooks() -> None:
        try:
            await asyncio.gather(*hooks)
        except Exception:
            logging.getLogger(__name__).exception("a step before stopping failed")

    stop.clear()
    again = asyncio.create_task(stop.wait())
    work = asyncio.create_task(run_hooks())
    await asyncio.wait([again, work], return_when=asyncio.FIRST_COMPLETED)
    for task in (again, work):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


#: Loggers kept at WARNING whatever ``--log-level`` says: at DEBUG botocore logs
#: request headers (X-Amz-Security-Token, signatures) and bodies.
QUIET_LOGGERS = ("botocore", "aiobotocore", "s3fs", "urllib3")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
