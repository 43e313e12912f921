"""The metadata DB schema, in SQLAlchemy 2's typed declarative style.

Alembic migrations in ``db/migrations`` are generated from these classes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from nbfleet.db.types import UTCDateTime


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class Org(Base):
    __tablename__ = "orgs"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime]


class Project(Base):
    __tablename__ = "projects"
    __table_args__ = (UniqueConstraint("org_id", "name"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"))
    name: Mapped[str] = mapped_column(String(100))
    #: Suspend this project's idle workspaces after this many seconds (None: the
    #: platform default, 0: never).
    idle_suspend_s: Mapped[int | None] = mapped_column(Integer)
    #: The project's own kernel limits (``model.limits.Limits.as_dict``; a None
    #: field, or no row value, takes the platform's default).
    kernel_limits: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    #: "egress": the project's kernels reach the public internet; None or "none":
    #: no network at all.
    kernel_network: Mapped[str | None] = mapped_column(String(16))
    #: GPU jobs: the project's fair-share weight, the GPUs preemption never takes
    #: it below, and caps on its running and queued jobs (None: no cap).
    job_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    job_guarantee_gpus: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    job_max_running: Mapped[int | None] = mapped_column(Integer)
    job_max_queued: Mapped[int | None] = mapped_column(Integer)
    #: The job tiers the project may use (None: all of them).
    job_tiers: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    #: What a workspace created without a resource request asks for (the JSON of a
    #: ``model.cluster.ResourceSpec``; None: nothing, i.e. no GPUs).
    default_resources: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    #: Workspace quotas (``model.quotas``): the project's totals, and what each of
    #: its users may hold; each a stored override (None: the defaults).
    quota: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    user_quota: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[datetime]


class User(Base):
    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("org_id", "name"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(100))
    is_admin: Mapped[bool] = mapped_column(default=False)
    #: This user's own workspace quota (``model.quotas``; None: the project's).
    quota: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[datetime]


class ApiToken(Base):
    """Only the SHA-256 of a token is stored; tokens carry 256 random bits."""

    __tablename__ = "api_tokens"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class Workspace(Base):
    __tablename__ = "workspaces"
    __table_args__ = (
        Index("ix_workspaces_tenant", "org_id", "project_id", "id"),
        Index("ix_workspaces_pending", "pending", "next_attempt_at"),
        #: A user's quota counts read only the user's rows.
        Index("ix_workspaces_owner", "owner_id", "desired_state"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(20))
    desired_state: Mapped[str] = mapped_column(String(20))
    #: Bumped on every desired-state change; agents refuse commands older than the last seen.
    generation: Mapped[int] = mapped_column(Integer, default=1)
    #: True while state and desired state disagree: the reconciler's work list.
    pending: Mapped[bool] = mapped_column(default=True)
    host_id: Mapped[str | None] = mapped_column(String(40), index=True)
    host_boot_id: Mapped[str | None] = mapped_column(String(40))
    last_error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None]
    #: The last complete snapshot: kernel id -> manifest key, the package layer key,
    #: its size and time. Written only once a suspend has saved everything, so a
    #: crash mid-suspend leaves the previous one in place.
    snapshot: Mapped[dict[str, Any] | None]
    #: What the last resume restored, per kernel (shown to the user).
    restore: Mapped[dict[str, Any] | None]
    #: Since when (DB clock) the store has lacked files its kernels wrote, as its
    #: host last reported; None while the store holds them all. Written when that
    #: changes, not at each heartbeat. What a lost host loses (``failover``).
    files_unsynced_since: Mapped[datetime | None]
    #: The resolved resource request (a ``ResourceSpec``'s JSON), fixed at creation
    #: so a later change of the project's default leaves it alone. None: a row from
    #: before requests existed, which asked for nothing.
    resources: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    #: Where the GPU scheduler placed the kernel: ``{"hosts": [...], "reserved":
    #: [...]}`` (its replicas' hosts, and GPUs held for its whole life). A new
    #: control plane rebuilds its model from it. None: no GPUs, or not placed.
    gpu_placement: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    #: The host the scheduler moves the kernel to (a cell's GPUs are there): its
    #: state is saved, and the next placement starts it on this host.
    move_to: Mapped[str | None] = mapped_column(String(40))
    #: The generation its runtime was placed with: a checkpoint's fencing token,
    #: with the host and its boot (``failover``).
    placed_generation: Mapped[int | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class StandbyReplica(Base):
    """A workspace kept warm on a host it does not run on (``control/standbys.py``)."""

    __tablename__ = "standby_replicas"
    workspace_id: Mapped[str] = mapped_column(ForeignKey("workspaces.id"), primary_key=True)
    host_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    #: The host's boot when the standby was made: another boot has lost it.
    boot_id: Mapped[str] = mapped_column(String(40))
    #: kernel id -> {"key", "cell"}: the checkpoint staged there, as the host said.
    staged: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    synced_at: Mapped[datetime | None]
    created_at: Mapped[datetime]


class WorkspaceEvent(Base):
    """One row per state change: the audit trail of a workspace."""

    __tablename__ = "workspace_events"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ForeignKey("workspaces.id"), index=True)
    from_state: Mapped[str | None] = mapped_column(String(20))
    to_state: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]


class Kernel(Base):
    """A kernel belongs to a workspace and outlives its processes across suspend/resume."""

    __tablename__ = "kernels"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # a UUID, as Jupyter expects
    workspace_id: Mapped[str] = mapped_column(ForeignKey("workspaces.id"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime]


class WebSession(Base):
    """A browser's sign-in: the cookie holds a random secret, only its SHA-256 is here."""

    __tablename__ = "web_sessions"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    session_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class NotebookSession(Base):
    """A Jupyter session (``/api/sessions``): which kernel a notebook path talks to.

    Kept in the DB, not in a server's memory, so it survives suspend, a control-plane
    restart and any replica answering the next request."""

    __tablename__ = "notebook_sessions"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # a UUID, as Jupyter expects
    workspace_id: Mapped[str] = mapped_column(ForeignKey("workspaces.id"), index=True)
    path: Mapped[str] = mapped_column(String(1024))
    name: Mapped[str] = mapped_column(String(1024))
    type: Mapped[str] = mapped_column(String(40))
    kernel_id: Mapped[str] = mapped_column(String(40), index=True)
    created_at: Mapped[datetime]


class LabState(Base):
    """A user's JupyterLab settings overrides and layouts, by key (``settings:PLUGIN``,
    ``layout:WORKSPACE:NAME``): what jupyterlab_server keeps in files, kept per user."""

    __tablename__ = "lab_state"
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(300), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime]


class Agent(Base):
    __tablename__ = "agents"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    url: Mapped[str] = mapped_column(String(300))
    #: Changes on every agent start: a new boot means its old runtimes are gone.
    boot_id: Mapped[str] = mapped_column(String(40))
    inventory: Mapped[dict[str, Any]]
    registered_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime]
    #: Set while an admin (or the agent itself, on SIGTERM) drains the host: it gets
    #: no new placements and its workspaces are moved away or suspended. In the DB
    #: so that a control-plane restart or another replica keeps draining it.
    draining_since: Mapped[datetime | None]
    #: What the current drain did so far (reset when a drain starts).
    drain_moved: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    drain_suspended: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: How far behind the store the files of its runtimes with nothing unsynced
    #: were at its last heartbeat, in seconds (about a sync interval).
    files_lag_s: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    #: Its disk is below the reserve kept for the platform: no new placements.
    disk_short: Mapped[bool] = mapped_column(default=False, server_default=false())


class IdempotencyKey(Base):
    """Stripe-style idempotency: the first response to a key is stored and replayed."""

    __tablename__ = "idempotency_keys"
    owner_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[dict[str, Any] | None]
    #: An unfinished claim may be taken over after this (its holder crashed).
    locked_until: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(index=True)  # for the retention purge


class Lease(Base):
    """A named lease with a fencing token, so one replica runs a singleton loop."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    holder: Mapped[str] = mapped_column(String(100))
    token: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"))
    expires_at: Mapped[datetime]
