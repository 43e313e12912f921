"""Job results: signed, expiring download URLs, and deletion after retention.

With a local blob store nbfleet serves the file itself at
``/v1/results/{job}/{attempt}/{name}?expires=…&signature=…``. The signature is an
HMAC-SHA256, under a key derived from the cluster secret, of exactly what the URL
grants (the job, the attempt, the file, the expiry), so changing any of them, or
waiting past the expiry, yields a 403. The URL is a capability: whoever holds it
may download until it expires, as with S3's presigned URLs, which nbfleet hands
out instead when the blob store is S3 (the bytes then never pass through the
control plane). A URL of nbfleet's own still works with S3: it redirects to a
presigned one that expires no later than it does.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.db.engine import Database
from nbfleet.db.job_tables import Job
from nbfleet.model.errors import DomainError, Forbidden
from nbfleet.storage.blobs import BlobStore


class Gone(DomainError):
    status = 410
    title = "Gone"


def signing_key(secret: str) -> bytes:
    """A key for result URLs only, so a URL never reveals anything about the secret."""
    return hmac.new(secret.encode(), b"nbfleet result urls v1", hashlib.sha256).digest()


def _message(job_id: str, attempt: int, name: str, expires: int) -> bytes:
    return f"{job_id}\n{attempt}\n{name}\n{expires}".encode()


def sign(key: bytes, job_id: str, attempt: int, name: str, expires: int) -> str:
    return hmac.new(key, _message(job_id, attempt, name, expires), hashlib.sha256).hexdigest()


def check(key: bytes, job_id: str, attempt: int, name: str, expires: int, signature: str,
          now_s: float) -> None:
    """Raise 403 unless the signature matches and has not expired.

    The signature comes from a URL, so it may be any text: it is compared as bytes
    in constant time, and text that is not ASCII (never a hex digest, and what
    ``compare_digest`` refuses to compare as ``str``) is simply invalid.
    """
    expected = sign(key, job_id, attempt, name, expires)
    if not signature.isascii() or not hmac.compare_digest(expected.encode(),
                                                          signature.encode("ascii")):
        raise Forbidden("invalid signature")
    if now_s >= expires:
        raise Forbidden("this link has expired; ask the API for a new one")


def downloads(job: Job, blobs: BlobStore, key: bytes, base_url: str, now_s: float,
              ttl_s: float) -> dict[str, Any]:
    """The result's files, each with a URL valid for ``ttl_s`` (never past retention)."""
    if not job.result:
        raise Gone(f"the result of {job.id} was deleted after its retention period")
    retention = job.result_expires_at.timestamp() if job.result_expires_at else now_s + ttl_s
    expires = int(min(now_s + ttl_s, retention))
    files = []
    for item in job.result:
        blob_key, name = str(item["key"]), str(item["name"])
        attempt = int(blob_key.split("/")[2])
        if blobs.local:
            query = urlencode({"expires": expires,
                               "signature": sign(key, job.id, attempt, name, expires)})
            url = f"{base_url}/v1/results/{job.id}/{attempt}/{quote(name)}?{query}"
        else:
            # Never outliving ``expires``: the whole seconds left, rounded down.
            url = blobs.signed_url(blob_key, int(expires - now_s), filename=name)
        files.append({"name": name, "size": item["size"], "sha256": item["sha256"], "url": url})
    return {"files": files, "url_expires_at": expires,
            "retained_until": job.result_expires_at.isoformat() if job.result_expires_at
            else None}


def result_key(job: Job, attempt: int, name: str) -> str:
    """The blob key of a file of this job's result, or 404-worthy None."""
    for item in job.result or []:
        if item["name"] == name and item["key"] == f"jobs/{job.id}/{attempt}/output/{name}":
            return str(item["key"])
    raise Gone(f"no such result file, or it was deleted after retention: {name}")


def expired(session: Session, now: datetime, limit: int = 100) -> list[str]:
    """Ended jobs whose retention is over and whose blobs are still kept."""
    return list(session.execute(
        select(Job.id).where(Job.result_expires_at <= now)
        .order_by(Job.result_expires_at).limit(limit)).scalars())


def blob_prefix(job_id: str) -> str:
    """Every blob of a job (results and logs of all attempts) is under this."""
    return f"jobs/{job_id}/"


def forget(session: Session, job_id: str, now: datetime) -> bool:
    """Drop the record of a job's blobs once retention ended (the caller has
    deleted them)."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or job.result_expires_at is None or job.result_expires_at > now:
        return False
    job.result = None
    job.result_expires_at = None
    job.updated_at = now
    return True


def purge(db: Database, blobs: BlobStore, limit: int = 100) -> int:
    """Delete the blobs of jobs past retention, then forget them; returns how many.

    The blobs first: a crash between leaves a record the next pass finishes, never
    blobs nobody knows of.
    """
    with db.transaction(write=False) as session:
        due = expired(session, db.now(session), limit)
    purged = 0
    for job_id in due:
        blobs.delete_prefix(blob_prefix(job_id))
        with db.transaction() as session:
            purged += forget(session, job_id, db.now(session))
    return purged
