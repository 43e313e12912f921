"""Printed output leaves the kernel in messages of bounded size.

ipykernel sends what a cell printed since its last flush (every 0.2 s) as one
``stream`` message: a loop that prints 1 GiB in a blink makes one 1 GiB message,
which the agent must hold whole before it can pass on or drop any of it. Here a
flush sends at most ``FLUSH_CHARS`` of it, the newest, after a line that says
how much was cut. (Splitting it into many messages instead would overflow
ZeroMQ's queue of 1,000 messages, which drops whatever comes next, a cell's
"idle" status included.) The agent also refuses messages past a hard size, for a
kernel that sends a giant one without this module
(``KernelProcess.max_message_bytes``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

#: Characters one flush of a stream sends (at most 4 bytes each in UTF-8): far
#: more than anyone reads in 0.2 s, far less than the agent's message bound.
FLUSH_CHARS = 2 << 20

Buffers = Callable[[], Iterator[tuple[dict[str, Any], str]]]


def _mib(chars: int) -> str:
    return f"{chars / (1 << 20):.1f} MiB"


def _bounded(buffers: Buffers) -> Buffers:
    def bounded() -> Iterator[tuple[dict[str, Any], str]]:
        for parent, data in buffers():
            if len(data) > FLUSH_CHARS:
                cut = len(data) - FLUSH_CHARS
                data = (f"[nbfleet] {_mib(cut)} of output were cut here: at most "
                        f"{_mib(FLUSH_CHARS)} is sent per flush (0.2 s)\n"
                        + data[cut:])
            yield parent, data
    return bounded


def bound_output() -> None:
    """Bound what the kernel's stdout and stderr send per flush.

    ipykernel's ``OutStream._flush`` sends one message per (parent, text) that its
    ``_flush_buffers`` yields; that generator is wrapped here. (Its public hooks do
    not serve: they are per thread, and the flush runs on the IO thread.) A stream
    that is not ipykernel's is left alone.
    """
    for stream in (sys.stdout, sys.stderr):
        buffers = getattr(stream, "_flush_buffers", None)
        if buffers is None or getattr(stream, "_nbfleet_bounded", False):
            continue
        stream._flush_buffers = _bounded(buffers)  # type: ignore[union-attr]
        stream._nbfleet_bounded = True  # type: ignore[union-attr]
