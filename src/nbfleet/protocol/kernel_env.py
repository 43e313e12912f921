"""Which environment variables a client's kernel start request may set.

Kernel Gateway and Enterprise Gateway clients (jupyter_server's ``--gateway-url``)
send ``{"name": ..., "env": {"KERNEL_USERNAME": ..., ...}}``. Only ``KERNEL_*``
names pass: anything else (``LD_PRELOAD``, ``PATH``, ``PYTHONPATH``,
``PYTHONSTARTUP``, ``BASH_ENV``...) could change what the kernel's interpreter
loads or runs, so it is dropped. Both the control plane and the agent filter with
this function (the agent again, as defense in depth). Pure: no I/O.
"""

from __future__ import annotations

import re

from nbfleet.model.errors import InvalidInput

#: A kernel variable's name: fullmatch, so a trailing newline never slips through.
NAME = re.compile(r"KERNEL_[A-Z0-9_]{1,64}")
MAX_VALUE_CHARS = 4096
MAX_ENTRIES = 32


def allowed_kernel_env(env: object) -> dict[str, str]:
    """The ``KERNEL_*`` variables of ``env`` a kernel may get; the rest is dropped.

    ``None`` is no variables. Raises :class:`InvalidInput` only when ``env`` is not
    a mapping of strings to strings (a client error worth saying); a name or value
    that is merely not allowed is dropped silently, as the gateways do.
    """
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
            isinstance(name, str) and isinstance(value, str) for name, value in env.items()):
        raise InvalidInput("env must be an object of string names to string values",
                           field="env")
    allowed: dict[str, str] = {}
    for name, value in env.items():
        if len(allowed) >= MAX_ENTRIES:
            break
        if NAME.fullmatch(name) and _value_ok(value):
            allowed[name] = value
    return allowed


def _value_ok(value: str) -> bool:
    """Short, without NUL (no environment can hold one) and encodable: a lone
    surrogate would fail the kernel's start, or its ``os.environ``."""
    if len(value) > MAX_VALUE_CHARS or "\0" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
