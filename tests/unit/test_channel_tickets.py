"""Channel tickets: a forged, altered, expired or misdirected ticket opens nothing."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from nbfleet.control.channel_tickets import TICKET_TTL, issue, user_of
from nbfleet.model.errors import Unauthorized

pytestmark = pytest.mark.no_db

SECRET = "cluster-secret"
NOW = datetime(2026, 11, 26, 12, tzinfo=UTC)


def test_a_ticket_names_its_user_for_its_workspace_until_it_expires() -> None:
    ticket, expires = issue(SECRET, "usr_1", "ws_a", NOW)
    assert expires == NOW + TICKET_TTL
    assert user_of(SECRET, ticket, "ws_a", NOW + TICKET_TTL - timedelta(seconds=1)) == "usr_1"
    with pytest.raises(Unauthorized):
        user_of(SECRET, ticket, "ws_a", NOW + TICKET_TTL)
    with pytest.raises(Unauthorized):
        user_of(SECRET, ticket, "ws_b", NOW)  # another workspace's kernels
    with pytest.raises(Unauthorized):
        user_of("another-secret", ticket, "ws_a", NOW)  # the secret rotated


def altered(ticket: str, user: str) -> str:
    body, signature = ticket.split(".", 1)
    payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
    _, workspace, expiry = payload.split(":")
    forged = base64.urlsafe_b64encode(f"{user}:{workspace}:{expiry}".encode()).decode()
    return f"{forged.rstrip('=')}.{signature}"


@pytest.mark.parametrize("forge", [
    lambda t: altered(t, "usr_admin"),  # someone else's name, the old signature
    lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),
    lambda t: t.split(".")[0],
    lambda t: "." + t.split(".")[1],
    lambda t: "garbage",
    lambda t: "a.b.c",
    lambda t: t + "x" * 400,
    lambda t: "é." + t.split(".")[1],
])
def test_forged_tickets_are_refused_with_one_message(forge: object) -> None:
    ticket, _ = issue(SECRET, "usr_1", "ws_a", NOW)
    with pytest.raises(Unauthorized, match="invalid or expired channel ticket"):
        user_of(SECRET, forge(ticket), "ws_a", NOW)  # type: ignore[operator]
