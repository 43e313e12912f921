"""Who may read the platform's own operational data, such as ``/metrics``.

Metrics reveal load, tenants' activity and the routes in use, so they are not
public: a scraper sends the cluster secret (Prometheus reads it from a
``credentials_file``), a person an admin token. Anyone else gets 401 without a
valid token, or 404 with an ordinary user's, as on the admin routes.
"""

from __future__ import annotations

from fastapi import Request

from nbfleet.control import auth
from nbfleet.control.deps import platform_of
from nbfleet.model.errors import NotFound
from nbfleet.web.credentials import is_cluster_secret
from nbfleet.web.problems import bearer_token


def require_operator(request: Request) -> None:
    """The cluster secret or an admin token, in the Authorization header only (a
    ``?token=`` would end up in scrape configs and access logs)."""
    platform = platform_of(request)
    token = bearer_token(request.headers.get("authorization"))
    if is_cluster_secret(token, platform.config.secret):
        return
    with platform.db.transaction(write=False) as session:
        principal = auth.resolve(session, token)
    if not principal.is_admin:
        raise NotFound("not found")
