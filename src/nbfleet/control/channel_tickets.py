"""Channel tickets: credentials in the URL path, for clients that cannot send any
other way on a kernel's WebSocket.

jupyter_server's ``GatewayKernelClient`` (what nbclient and papermill use with a
gateway) opens ``{ws_url}/api/kernels/{id}/channels`` with no header, cookie or
query string: it cannot authenticate. It can be pointed at another ``ws_url``
(``JUPYTER_GATEWAY_WS_URL``), so a ticket goes in that URL's path:
``/t/{ticket}/v1/workspaces/{id}``. A ticket is narrow, as a secret in a URL must
be (it lands in access logs): it opens only the channels of one workspace's kernels,
for the user it was issued to (who must still see the workspace), for 12 hours. It
is an HMAC of the cluster secret, so nothing is stored; rotating the cluster secret
revokes every ticket.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import datetime, timedelta

from sqlalchemy import select

from nbfleet.control.auth import Principal
from nbfleet.db.engine import Database
from nbfleet.db.tables import User
from nbfleet.model.errors import Unauthorized

TICKET_TTL = timedelta(hours=12)
_PURPOSE = b"nbfleet kernel channels\n"
INVALID = "invalid or expired channel ticket"


def _sign(secret: str, payload: bytes) -> str:
    return hmac.new(secret.encode(), _PURPOSE + payload, hashlib.sha256).hexdigest()[:40]


def issue(secret: str, user_id: str, workspace_id: str, now: datetime) -> tuple[str, datetime]:
    expires = now + TICKET_TTL
    payload = f"{user_id}:{workspace_id}:{int(expires.timestamp())}".encode()
    body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    return f"{body}.{_sign(secret, payload)}", expires


def user_of(secret: str, ticket: str, workspace_id: str, now: datetime) -> str:
    """The user a ticket was issued to, if it is genuine, unexpired and for this
    workspace; else 401 (one message for every failure)."""
    try:
        body, signature = ticket.split(".", 1)
        payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        user_id, for_workspace, expiry = payload.decode().split(":")
        expires_at = int(expiry)
    except (ValueError, UnicodeDecodeError):
        raise Unauthorized(INVALID) from None
    if len(ticket) > 300 or not hmac.compare_digest(_sign(secret, payload).encode(),
                                                     signature.encode("utf-8", "replace")):
        raise Unauthorized(INVALID)
    if for_workspace != workspace_id or now.timestamp() >= expires_at:
        raise Unauthorized(INVALID)
    return user_id


def principal(db: Database, secret: str, ticket: str, workspace_id: str) -> Principal:
    with db.transaction(write=False) as session:
        user_id = user_of(secret, ticket, workspace_id, db.now(session))
        row = session.execute(select(User.id, User.org_id, User.project_id, User.is_admin)
                              .where(User.id == user_id)).first()
    if row is None:
        raise Unauthorized(INVALID)
    return Principal(row[0], row[1], row[2], bool(row[3]))
