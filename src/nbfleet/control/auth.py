"""Tokens, principals and tenant scoping.

A token is 256 random bits; only its SHA-256 is stored, which is safe for
high-entropy secrets and keeps the per-request check to one indexed lookup.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.db.queries import among
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


MISSING = "missing credentials: send 'Authorization: Bearer <token>'"
INVALID = "invalid or revoked token"


def resolve(session: Session, token: str | None) -> Principal:
    if not token:
        raise Unauthorized(MISSING)
    principal = resolve_many(session, [token]).get(token)
    if principal is None:
        raise Unauthorized(INVALID)
    return principal


def resolve_many(session: Session, tokens: Collection[str]) -> dict[str, Principal]:
    """The principals of the valid tokens among ``tokens`` (one query for a batch)."""
    hashes = {hash_token(token): token for token in tokens if token}
    if not hashes:
        return {}
    rows = session.execute(
        select(ApiToken.token_hash, User.id, User.org_id, User.project_id, User.is_admin)
        .join(User, ApiToken.user_id == User.id)
        .where(among(session, ApiToken.token_hash, sorted(hashes)), ApiToken.revoked_at.is_(None))
    )
    return {hashes[token_hash]: Principal(user_id, org_id, project_id, is_admin)
            for token_hash, user_id, org_id, project_id, is_admin in rows}
