"""Workspace quotas: how many workspaces, running workspaces, kernels per workspace
and GPUs a user and a project may hold (pure rules: no I/O, no clock).

Why: one ordinary user's script created 26 workspaces, each reserving its whole
disk image, and other tenants' placements then failed. A per-user default stops a
runaway script without an admin having to think of it first; project totals are
there for admins who want to share a fleet between teams, so they are unlimited
until set (a project may be one person or a thousand; no default fits both).

Three layers, the nearest set value winning: a user's own override, then the
project's per-user quota, then :data:`DEFAULT_USER_QUOTA`. A project's totals are
its own override over :data:`DEFAULT_PROJECT_QUOTA`. In a stored override a
field is an integer, :data:`UNLIMITED`, or absent (inherit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from nbfleet.model.errors import DomainError, InvalidInput

#: A stored override's "no limit at all" (as opposed to absent: inherit).
UNLIMITED = "unlimited"
#: The largest limit accepted (anything above is unlimited in practice).
MAX_LIMIT = 1_000_000

Field = Literal["workspaces", "running", "kernels_per_workspace", "gpus"]
FIELDS: tuple[Field, ...] = ("workspaces", "running", "kernels_per_workspace", "gpus")
Scope = Literal["user", "project"]

#: What each limit counts, as a refusal names it.
WHAT: dict[Field, str] = {
    "workspaces": "workspaces (all but deleted ones)",
    "running": "running workspaces (asked to run: creating, running or resuming)",
    "kernels_per_workspace": "kernels in one workspace",
    "gpus": "GPUs asked for by running workspaces",
}
#: What a caller can do about each limit besides asking an admin.
RELIEF: dict[Field, str] = {
    "workspaces": "delete a workspace",
    "running": "suspend or delete a running workspace",
    "kernels_per_workspace": "shut down a kernel of this workspace",
    "gpus": "suspend a workspace that asks for GPUs",
}


@dataclass(frozen=True, slots=True)
class Quota:
    """Effective limits; ``None`` is unlimited."""

    workspaces: int | None = None
    running: int | None = None
    kernels_per_workspace: int | None = None
    gpus: int | None = None

    def limit(self, name: Field) -> int | None:
        value: int | None = getattr(self, name)
        return value

    def over(self, override: Mapping[str, Any] | None) -> Quota:
        """These limits with ``override``'s set fields taking precedence."""
        if not override:
            return self
        changes = {name: None if value == UNLIMITED else int(value)
                   for name, value in override.items() if name in FIELDS and value is not None}
        return replace(self, **changes)

    def as_dict(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def limits_anything(self) -> bool:
        return any(value is not None for value in self.as_dict().values())


#: Every user's limits until an admin sets others. 20 workspaces and 10 running
#: are far above what a person uses by hand (the fuzz run's 26 is a script's) and
#: bound what one user's runaway loop can reserve: 10 running disk images and
#: runtimes. 8 kernels per workspace covers a notebook, a console and a few
#: others open at once. GPUs are left to credits and to project totals: a user's
#: GPUs are paid for, and the scarce ones are a project's to share out.
DEFAULT_USER_QUOTA = Quota(workspaces=20, running=10, kernels_per_workspace=8, gpus=None)
#: A project's totals until an admin sets them: unlimited (see the module's why).
DEFAULT_PROJECT_QUOTA = Quota()


def check_override(value: Mapping[str, Any] | None) -> dict[str, int | str] | None:
    """A stored override from an admin's request: set fields only (None: nothing
    set). Each value is 0 to MAX_LIMIT or ``"unlimited"``; 0 freezes the count."""
    if not value:
        return None
    result: dict[str, int | str] = {}
    for name, item in value.items():
        if name not in FIELDS:
            raise InvalidInput(f"unknown quota {name!r}; known: {', '.join(FIELDS)}",
                               field=name)
        if item is None:
            continue
        if item == UNLIMITED:
            result[name] = UNLIMITED
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= MAX_LIMIT:
            result[name] = item
        else:
            raise InvalidInput(f"quota {name} must be 0 to {MAX_LIMIT} or {UNLIMITED!r}, "
                               f"not {item!r}", field=name)
    return result or None


@dataclass(frozen=True, slots=True)
class Usage:
    """What a user or a project holds now (``kernels``: in the one workspace judged)."""

    workspaces: int = 0
    running: int = 0
    kernels_per_workspace: int = 0
    gpus: int = 0

    def count(self, name: Field) -> int:
        value: int = getattr(self, name)
        return value


class QuotaExceeded(DomainError):
    """Over a quota: 403, not 429, since waiting does not help (something must be
    suspended or deleted, or an admin must raise the limit), and clients that retry
    429 on their own would only spin. The problem names the limit, its value, the
    current count and how to raise it."""

    status = 403
    title = "Quota exceeded"


def refusal(scope: Scope, name: Field, limit: int, current: int, adding: int,
            raise_with: str) -> QuotaExceeded:
    """The error for asking ``adding`` more of ``name`` over ``limit``."""
    whose = "your" if scope == "user" else "your project's"
    return QuotaExceeded(
        f"{scope} quota exceeded: {whose} limit is {limit} {WHAT[name]}"
        f"{' per user' if scope == 'user' and name != 'kernels_per_workspace' else ''}, "
        f"{current} in use, and this asks for {adding} more; {RELIEF[name]}, or ask an "
        f"admin to raise it ({raise_with})",
        reason="quota_exceeded", scope=scope, quota=name, limit=limit, current=current,
        requested=adding)


def first_excess(quota: Quota, usage: Usage, adding: Mapping[Field, int]
                 ) -> tuple[Field, int, int, int] | None:
    """The first limit that ``adding`` would go over: (name, limit, current,
    adding), or None. Asking for none of something never fails on it, so a limit
    lowered below what is held refuses only new holdings, never what exists."""
    for name in FIELDS:
        wanted = adding.get(name, 0)
        limit = quota.limit(name)
        if wanted > 0 and limit is not None and usage.count(name) + wanted > limit:
            return name, limit, usage.count(name), wanted
    return None


def check(scope: Scope, quota: Quota, usage: Usage, adding: Mapping[Field, int],
          raise_with: str) -> None:
    """Raise :class:`QuotaExceeded` if ``adding`` goes over any of ``quota``."""
    excess = first_excess(quota, usage, adding)
    if excess is not None:
        raise refusal(scope, *excess, raise_with=raise_with)
