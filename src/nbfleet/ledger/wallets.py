"""Wallets: an org's shared pool and each project's own credits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nbfleet.db.credit_tables import Wallet
from nbfleet.db.ids import new_id
from nbfleet.db.tables import Org, Project
from nbfleet.model.errors import NotFound


@dataclass(frozen=True, slots=True)
class WalletOwner:
    """Names and ids of the org (and project) a wallet belongs to."""

    org_id: str
    org: str
    project_id: str | None = None
    project: str | None = None

    @property
    def key(self) -> str:
        return f"project:{self.project_id}" if self.project_id else f"org:{self.org_id}"


def owner_by_names(session: Session, org: str, project: str | None) -> WalletOwner:
    """Resolve names to ids; a missing org or project is 404."""
    org_row = session.execute(select(Org).where(Org.name == org)).scalar_one_or_none()
    if org_row is None:
        raise NotFound(f"org {org!r} not found")
    if project is None:
        return WalletOwner(org_row.id, org_row.name)
    project_row = session.execute(
        select(Project).where(Project.org_id == org_row.id, Project.name == project)
    ).scalar_one_or_none()
    if project_row is None:
        raise NotFound(f"project {org}/{project} not found")
    return WalletOwner(org_row.id, org_row.name, project_row.id, project_row.name)


def owner_by_ids(session: Session, org_id: str, project_id: str | None) -> WalletOwner:
    org_row = session.get(Org, org_id)
    if org_row is None:
        raise NotFound(f"org {org_id} not found")
    if project_id is None:
        return WalletOwner(org_id, org_row.name)
    project_row = session.get(Project, project_id)
    if project_row is None or project_row.org_id != org_id:
        raise NotFound(f"project {project_id} not found")
    return WalletOwner(org_id, org_row.name, project_id, project_row.name)


def find(session: Session, owner: WalletOwner) -> Wallet | None:
    return session.execute(select(Wallet).where(Wallet.owner == owner.key)).scalar_one_or_none()


def ensure(session: Session, owner: WalletOwner, now: datetime) -> Wallet:
    """The owner's wallet, created on first use (a racing creator's row wins)."""
    wallet = find(session, owner)
    if wallet is not None:
        return wallet
    wallet = Wallet(id=new_id("wal"), owner=owner.key, org_id=owner.org_id,
                    project_id=owner.project_id, created_at=now)
    try:
        with session.begin_nested():
            session.add(wallet)
    except IntegrityError:
        found = find(session, owner)
        assert found is not None
        return found
    return wallet
