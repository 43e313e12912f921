"""A lean HTTP/1.1 load generator: keep-alive connections on raw asyncio streams.

The benchmarks run the server and its clients on the same two cores. httpx costs
its caller 0.7 to 2 ms of CPU per request, which here is more than the server's
own work, so the clients, not the server, would set the ceiling. Like wrk, this
sends prebuilt request bytes and reads just the status line, the headers it needs
and the body: tens of microseconds per request. It speaks only what the
benchmarks need (``Content-Length`` bodies, no chunked transfer encoding).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

#: Builds request ``n`` of a run for connection ``worker``: (method, path, headers, body).
RequestSpec = tuple[str, str, Mapping[str, str], Any]
MakeRequest = Callable[[int, int], RequestSpec]


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes


def encode(host: str, method: str, path: str, headers: Mapping[str, str], body: Any) -> bytes:
    """One request's bytes (``body``: None, bytes, or JSON-encodable)."""
    payload = b"" if body is None else body if isinstance(body, bytes) else \
        json.dumps(body, separators=(",", ":")).encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(payload)}"]
    if body is not None and not isinstance(body, bytes):
        lines.append("Content-Type: application/json")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class Connection:
    """One keep-alive connection; requests on it go one after the other."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        return cls(reader, writer, parts.netloc)

    async def send(self, method: str, path: str, headers: Mapping[str, str],
                   body: Any = None) -> Answer:
        self.writer.write(encode(self.host, method, path, headers, body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, _, header_block = head.partition(b"\r\n")
        length = 0
        for line in header_block.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                raise RuntimeError("chunked responses are not supported by this client")
        return Answer(int(status_line.split(b" ", 2)[1]), await self.reader.readexactly(length))

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@dataclass(frozen=True, slots=True)
class Run:
    per_s: float
    elapsed_s: float
    #: This process's CPU per request (the clients), in ms.
    client_cpu_ms: float


async def blast(connections: Sequence[Connection], make: MakeRequest, total: int,
                expect: int) -> Run:
    """``total`` requests, one worker per connection, all at once. Raises on the
    first answer whose status is not ``expect``."""
    counter = itertools.count()

    async def worker(index: int) -> None:
        while (n := next(counter)) < total:
            method, path, headers, body = make(n, index)
            answer = await connections[index].send(method, path, headers, body)
            if answer.status != expect:
                raise RuntimeError(f"{method} {path}: {answer.status} {answer.body[:300]!r}")

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(len(connections))))
    elapsed = time.perf_counter() - start
    return Run(total / elapsed, elapsed, (time.process_time() - cpu) * 1000 / total)
