"""Everything JupyterLab calls, under ``/w/{workspace_id}``: its page and assets,
settings and layouts, contents, sessions, and the same kernel routes as the
Kernel Gateway API."""

from __future__ import annotations

from fastapi import APIRouter

from nbfleet.control.lab import assets, contents, events, page, sessions, settings
from nbfleet.control.routers import gateway

router = APIRouter(include_in_schema=False)
# The page's catch-all (``/lab/{rest}``) goes last: ``/lab/api/...`` is settings'.
for module in (assets, settings, contents, sessions, events, page):
    router.include_router(module.router)
router.include_router(gateway.routes, prefix="/w/{workspace_id}")
