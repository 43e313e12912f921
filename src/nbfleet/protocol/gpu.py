"""Per-cell GPU binding: what travels from the control plane to a kernel and back.

The control plane decides which GPUs a cell may use (the policy's ``Started``)
and writes a :class:`CellBinding` into the ``execute_request``'s metadata under
:data:`BINDING_KEY`. The agent forwards it to the kernel and remembers it until
the cell's ``execute_reply`` (or the kernel's death), reporting what is still
bound as :class:`ActiveBinding`; that report is how a restarted control plane
learns which GPUs are busy. The kernel extension reads the binding and exposes
the GPUs to the cell's code.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: The key of the binding in an ``execute_request``'s metadata.
BINDING_KEY = "nbfleet_binding"


class CellBinding(BaseModel):
    """The GPUs one cell may use, on the host that runs it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    task_id: str = Field(min_length=1, max_length=200)
    host_id: str = Field(min_length=1, max_length=100)
    gpu_indices: tuple[int, ...] = ()
    gpu_type: str = ""


class ActiveBinding(BaseModel):
    """A binding an agent has forwarded and whose cell has not replied yet."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kernel_id: str
    msg_id: str
    binding: CellBinding
    #: Seconds since the agent forwarded the cell, on the agent's monotonic clock.
    age_s: float = Field(ge=0)
    #: The cell ended, but a process of its slot still holds one of its GPUs open:
    #: the GPU is still the cell's (no other slot on the agent may open it), and
    #: the agent reports the cell released only once the GPU is closed; until then
    #: it is committed, and billed, to the cell.
    held: bool = False


class AgentBindings(BaseModel):
    """An agent's answer to "what is bound on you now?"."""

    bindings: list[ActiveBinding] = Field(default_factory=list)


class ReleasedCells(BaseModel):
    """An agent's report that these cells ended (reply, interrupt, death, restart)."""

    agent_id: str
    #: Their GPUs are closed: the control plane gives them back.
    task_ids: list[str] = Field(default_factory=list, max_length=10_000)
    #: Ended while a process of their slot still holds one of their GPUs open (a CUDA
    #: context): still committed and billed; the kernel's next cell may take them
    #: over. Their release follows in a later report, once closed.
    held: list[str] = Field(default_factory=list, max_length=10_000)
