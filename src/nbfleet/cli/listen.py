"""The servers' listening sockets, bound before any state is touched.

A busy or invalid port is the commonest start-up mistake; it gets one line that
says what to change instead of a traceback from deep inside the server.
"""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """A port that cannot be listened on; the message is one line for the CLI."""


def parse_port(text: str) -> int:
    """``--port``'s value: an integer from 0 (any free port) to 65535."""
    try:
        port = int(text.strip(), 10)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ListenError(f"--port must be a number from 0 to 65535, not {text!r}")
    return port


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, inheritable by forked workers.

    IPPROTO_TCP must be explicit: asyncio only disables Nagle's algorithm on
    accepted sockets whose proto says TCP, and with Nagle every cell paid a 40 ms
    delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening at once: a connection that arrives while the server is still
        # starting (the control plane placing a workspace on an agent that has just
        # registered) waits in the backlog instead of being refused.
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(_explain(exc, host, port)) from None
    sock.set_inheritable(True)
    return sock


def _explain(exc: OSError, host: str, port: int) -> str:
    if isinstance(exc, socket.gaierror):
        return f"cannot listen on {host!r}: not a known host name or address (pass --host)"
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use (pass --port)"
    if exc.errno == errno.EACCES:
        return (f"no permission to listen on port {port} of {host} "
                "(ports below 1024 need privileges; pass --port)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine (pass --host)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
