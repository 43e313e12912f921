"""Which host uid a sandbox runs as.

A root agent runs each slot as its own unprivileged uid, never the agent's and
never another slot's: files a kernel writes belong to that uid, and a kernel that
escaped its namespaces would still be an unprivileged user with no claim on
another tenant's files or processes. Uids are drawn at random from a range no
distribution hands out to people (``SANDBOX_UIDS``), so several agents on one host
do not need to coordinate; a collision within one agent is avoided outright.

An unprivileged agent cannot switch uids: its kernels map to the agent's own uid
and rely on the namespaces alone (the start-up report says so).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from nbfleet.storage.beneath import chown_tree

#: 2^20 .. 2^31 - 2^20: far above the ids that useradd and systemd's dynamic users give.
SANDBOX_UIDS = range(1 << 20, (1 << 31) - (1 << 20))
#: The uid and gid the kernel sees for itself inside its user namespace.
INNER_ID = 1000


@dataclass(frozen=True, slots=True)
class Identity:
    uid: int
    gid: int


class Identities:
    def __init__(self, ids: range = SANDBOX_UIDS) -> None:
        self.ids = ids
        self.in_use: set[int] = set()

    def allocate(self) -> Identity:
        while True:
            uid = self.ids.start + secrets.randbelow(len(self.ids))
            if uid not in self.in_use:
                self.in_use.add(uid)
                return Identity(uid, uid)

    def release(self, identity: Identity) -> None:
        self.in_use.discard(identity.uid)


def hand_over(path: str, identity: Identity | None) -> None:
    """Make ``path`` (recursively) the sandbox's own, so the kernel may change what
    the agent wrote for it; links are changed themselves, never followed, so a link
    the kernel planted hands nothing else over."""
    if identity is not None:
        chown_tree(path, (identity.uid, identity.gid))
