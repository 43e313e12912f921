"""A kernel's state after a cell, reported by the agent that ran it.

The agent uploads the kernel's state to the blob store after each cell, off the
reply path, then reports its key here. The control plane records it as the
workspace's latest state for that kernel, so a placement after the host is lost
restores the last completed cell. The database is the one serialisation point: a
report is kept only from the host the workspace runs on now, in the boot and
generation it was placed with (the fencing token). One task per kernel on the
agent reports in order, so within a placement a report follows the one before.

A restarted kernel (its user's restart, or the agent's after a crash) is reported
the same way, with no key: its variables are gone on purpose, so a later placement
must not bring back those of a cell before the restart.

A checkpoint that could not be taken (the state did not fit its disk, did not
pickle, the store refused it) is reported too, with no key and ``failed``: the
last kept state stays, and the workspace says which cell it is behind and why.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class CellCheckpoint(BaseModel):
    """``POST /internal/workspaces/{workspace_id}/checkpoints``."""

    agent_id: str = Field(max_length=200)
    boot_id: str = Field(max_length=200)
    generation: int = Field(ge=1)
    kernel_id: str = Field(max_length=200)
    #: The snapshot's manifest in the blob store; None: the kernel's process was
    #: restarted and nothing is saved (its namespace is empty as of the restart).
    key: str | None = Field(max_length=1024)
    bytes: int = Field(ge=0)
    written: int = Field(ge=0)
    #: The execution count of the last cell the state includes (0: none ran yet,
    #: as for a restart); for a failure, the cell whose state could not be saved.
    cell: int = Field(ge=0)
    #: Why the state after ``cell`` could not be checkpointed (no key then).
    failed: str | None = Field(default=None, max_length=1000)

    @model_validator(mode="after")
    def _a_restart_saved_nothing(self) -> CellCheckpoint:
        """A restart's or a failure's report names no state, so it carries no size
        (and a restart no cell)."""
        if self.failed is not None:
            if self.key is not None or self.bytes or self.written:
                raise ValueError("a failed checkpoint saved nothing: no key, bytes or written")
        elif self.key is None and (self.bytes or self.written or self.cell):
            raise ValueError("a restart (no key) saved nothing: bytes, written and cell are 0")
        return self


class CheckpointRecorded(BaseModel):
    """Whether the control plane kept it; ``replaced``: the key it no longer names
    (the agent may delete it if it uploaded it), or None."""

    kept: bool
    reason: str | None = None
    replaced: str | None = None


# --------------------------------------------------------------- standbys
class StageCheckpoint(BaseModel):
    """``POST /agent/v1/standbys/{workspace_id}/stage``: a newer checkpoint of one
    kernel, to download next to its standby (``agent/standbys.py``)."""

    generation: int = Field(ge=1)
    kernel_id: str = Field(max_length=200)
    key: str = Field(max_length=1024)
    cell: int | None = Field(None, ge=0)


class StagedKernel(BaseModel):
    """A kernel a standby keeps, and the checkpoint staged for it (None: none yet)."""

    key: str | None = None
    cell: int | None = None


class StandbyState(BaseModel):
    """What a standby holds: each kernel's staged checkpoint."""

    kernels: dict[str, StagedKernel] = {}
