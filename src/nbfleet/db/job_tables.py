"""GPU jobs: the binary registry, jobs, their attempts and events, GPU allocations,
fair-share usage and the poison-input quarantine. ``docs/jobs.md`` explains them."""

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
)
from sqlalchemy.orm import Mapped, mapped_column

from nbfleet.db.tables import Base

_BIGINT = BigInteger().with_variant(Integer, "sqlite")


class BinaryVersion(Base):
    """One version of a registered binary: its command and its rollout state.

    Per name, at most one version is ``stable`` and at most one is ``canary``.
    """

    __tablename__ = "binary_versions"
    __table_args__ = (UniqueConstraint("name", "version"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(50))
    #: argv prefix; arguments follow as ``--name=value`` flags.
    command: Mapped[list[str]] = mapped_column(JSON)
    #: stable | canary | rolled_back | retired
    state: Mapped[str] = mapped_column(String(20))
    canary_percent: Mapped[int] = mapped_column(Integer, default=0)
    failure_threshold: Mapped[float] = mapped_column(Float)
    min_samples: Mapped[int] = mapped_column(Integer)
    #: Attempts that ended other than by infrastructure failure, and the binary's
    #: failures among them: the canary's failure rate.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    binary_failures: Mapped[int] = mapped_column(Integer, default=0)
    infra_failures: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant", "org_id", "project_id", "id"),
        # The dispatcher's read: queued jobs per tier and tenant, in FIFO order.
        Index("ix_jobs_queue", "state", "priority", "project_id", "created_at", "id"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str | None] = mapped_column(String(200))
    binary: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(50))
    pinned: Mapped[bool]
    args: Mapped[dict[str, Any]]
    gpus: Mapped[int] = mapped_column(Integer)
    gpu_types: Mapped[list[str]] = mapped_column(JSON)
    vram_gb: Mapped[int] = mapped_column(Integer)
    memory_mb: Mapped[int] = mapped_column(Integer)
    timeout_s: Mapped[int] = mapped_column(Integer)
    idle_timeout_s: Mapped[int] = mapped_column(Integer)
    max_attempts: Mapped[int] = mapped_column(Integer)
    tier: Mapped[str] = mapped_column(String(20))
    priority: Mapped[int] = mapped_column(Integer)
    preemptible: Mapped[bool]
    state: Mapped[str] = mapped_column(String(20))
    #: The current (or last) attempt's number: the fencing token every worker
    #: write carries. 0 until the first dispatch.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    #: The active hold of the current (or next) attempt.
    hold_id: Mapped[str | None] = mapped_column(String(40))
    #: The rate the admission hold was priced at (the dearest acceptable type).
    max_rate: Mapped[int] = mapped_column(BigInteger)
    max_rate_type: Mapped[str] = mapped_column(String(40))
    host_id: Mapped[str | None] = mapped_column(String(40))
    gpu_type: Mapped[str | None] = mapped_column(String(40))
    avoid_hosts: Mapped[list[str]] = mapped_column(JSON)
    #: A retry waits for this (backoff); None: dispatchable now.
    next_attempt_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    preempt_requested: Mapped[bool] = mapped_column(default=False)
    reason: Mapped[str | None] = mapped_column(Text)
    quarantined: Mapped[bool] = mapped_column(default=False)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    #: [{"name", "key", "size", "sha256"}] once it succeeded; cleared at retention.
    result: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    #: When the job's blobs (result and logs) are deleted; None once they are.
    result_expires_at: Mapped[datetime | None] = mapped_column(index=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class JobAttempt(Base):
    """One try of a job on one host. Ended attempts are never rewritten."""

    __tablename__ = "job_attempts"
    __table_args__ = (Index("ix_job_attempts_live", "state", "last_heartbeat_at"),)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[str] = mapped_column(String(40), index=True)
    host_boot_id: Mapped[str] = mapped_column(String(40))
    gpu_type: Mapped[str] = mapped_column(String(40))
    gpu_indices: Mapped[list[int]] = mapped_column(JSON)
    rate_per_gpu_hour: Mapped[int] = mapped_column(BigInteger)
    hold_id: Mapped[str] = mapped_column(String(40))
    binary_version: Mapped[str] = mapped_column(String(50))
    #: scheduled | running | ended
    state: Mapped[str] = mapped_column(String(20))
    outcome: Mapped[str | None] = mapped_column(String(20))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[str | None] = mapped_column(Text)
    gpu_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    seq: Mapped[int] = mapped_column(Integer, default=0)
    progress: Mapped[float | None] = mapped_column(Float)
    log_chunks: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    last_heartbeat_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]


class GpuAllocation(Base):
    """A GPU bound to a job attempt. The primary key makes a double binding
    impossible, whatever any dispatcher believes."""

    __tablename__ = "gpu_allocations"
    host_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    attempt: Mapped[int] = mapped_column(Integer)


class JobEvent(Base):
    """One row per state change: the audit trail of a job."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(_BIGINT, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    from_state: Mapped[str | None] = mapped_column(String(20))
    to_state: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]


class TenantUsage(Base):
    """Each tenant's (project's) GPU-seconds, decayed lazily from ``at``."""

    __tablename__ = "tenant_usage"
    tenant_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    gpu_seconds: Mapped[float] = mapped_column(Float)
    at: Mapped[datetime]


class QuarantinedInput(Base):
    """An input that failed on several hosts; the same input is refused at submit."""

    __tablename__ = "quarantined_inputs"
    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    binary: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(50))
    job_id: Mapped[str] = mapped_column(String(40))
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
