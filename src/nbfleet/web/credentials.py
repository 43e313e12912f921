"""Checking a presented bearer token against the cluster secret.

Shared by the control plane and the agents. ``hmac.compare_digest`` keeps the
comparison constant-time; it runs on bytes because, given a str holding a
non-ASCII character (any request header may), it raises TypeError, a 500.
"""

from __future__ import annotations

import hmac


def is_cluster_secret(token: str | None, secret: str) -> bool:
    if not token or not secret:
        return False
    return hmac.compare_digest(token.encode(), secret.encode())
