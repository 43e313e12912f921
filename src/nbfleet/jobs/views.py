"""Jobs and attempts as the API shows them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nbfleet.db.job_tables import Job, JobAttempt
from nbfleet.web.render import iso


def attempt_view(row: JobAttempt) -> dict[str, Any]:
    return {"attempt": row.attempt, "state": row.state, "outcome": row.outcome,
            "host_id": row.host_id, "gpu_type": row.gpu_type, "gpu_indices": row.gpu_indices,
            "rate_per_gpu_hour": row.rate_per_gpu_hour, "hold_id": row.hold_id,
            "binary_version": row.binary_version, "exit_code": row.exit_code,
            "signal": row.signal, "detail": row.detail, "gpu_ms": row.gpu_ms,
            "progress": row.progress, "log_chunks": row.log_chunks,
            "created_at": iso(row.created_at), "started_at": iso(row.started_at),
            "last_heartbeat_at": iso(row.last_heartbeat_at), "ended_at": iso(row.ended_at)}


def job_view(job: Job, attempts: Sequence[JobAttempt] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": job.id, "name": job.name, "state": job.state, "reason": job.reason,
        "binary": job.binary, "version": job.version, "pinned": job.pinned, "args": job.args,
        "resources": {"gpus": job.gpus, "gpu_types": job.gpu_types, "vram_gb": job.vram_gb,
                      "memory_mb": job.memory_mb},
        "timeout_s": job.timeout_s, "idle_timeout_s": job.idle_timeout_s,
        "max_attempts": job.max_attempts, "tier": job.tier, "priority": job.priority,
        "preemptible": job.preemptible, "project_id": job.project_id,
        "attempt": job.attempt, "host_id": job.host_id, "gpu_type": job.gpu_type,
        "hold_id": job.hold_id, "cancel_requested": job.cancel_requested,
        "quarantined": job.quarantined, "has_result": bool(job.result),
        "next_attempt_at": iso(job.next_attempt_at), "created_at": iso(job.created_at),
        "started_at": iso(job.started_at), "finished_at": iso(job.finished_at),
        "updated_at": iso(job.updated_at), "retained_until": iso(job.result_expires_at)}
    if attempts is not None:
        body["attempts"] = [attempt_view(row) for row in attempts]
    return body
