"""Tokens, principals and tenant scoping.

A token is 256 random bits; only its SHA-256 is stored, which is safe for
high-entropy secrets and keeps the per-request check to one indexed lookup.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.db.tables import ApiToken, User
from nbfleet.model.errors import Unauthorized

TOKEN_PREFIX = "nbf_"


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: str
    org_id: str
    project_id: str
    is_admin: bool = False

    def can_see(self, org_id: str, project_id: str) -> bool:
        """Tenancy: a project's resources are visible to its users (and admins)."""
        return self.is_admin or (org_id == self.org_id and project_id == self.project_id)


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def resolve(session: Session, token: str | None) -> Principal:
    if not token:
        raise Unauthorized("missing credentials: send 'Authorization: Bearer <token>'")
    row = session.execute(
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    ).scalar_one_or_none()
    if row is None:
        raise Unauthorized("invalid or revoked token")
    return Principal(row.id, row.org_id, row.project_id, row.is_admin)
