"""The admin API's answer about a host's drain, declared once for the API and the CLI."""

from __future__ import annotations

from pydantic import BaseModel, Field


class HostDrainState(BaseModel):
    """Where a host's drain stands. ``workspaces`` and ``kernels`` count what still
    has its runtime there (a drained host is done when both are 0); ``moved`` and
    ``suspended`` count what the current drain sent away, and how."""

    id: str
    draining: bool
    draining_since: str | None = Field(None, description="When the drain began (ISO 8601)")
    workspaces: int = Field(description="Workspaces whose runtime is still on the host")
    kernels: int = Field(description="Kernels of those workspaces")
    moved: int = Field(0, description="Workspaces this drain moved to another host")
    suspended: int = Field(0, description="Workspaces this drain suspended (no other host)")
