"""The calls between the control plane and an agent: every body, declared once.

The control plane's :class:`~nbfleet.control.agent_client.AgentClient` builds its
orders from these models and validates the agent's answers into them; the
agent's app (``nbfleet.agent.app``) takes the same models as its request bodies
and answers with them. The agent's own reports to the control plane
(registration, heartbeats, job heartbeats and finishes, under ``/internal``) are
declared here too. The GPU binding contract is in :mod:`nbfleet.protocol.gpu`.

Field names are the JSON on the wire. Fields with a default may be left out by
the sender; the others must be there, so an answer missing one fails where it is
read instead of as a ``None`` further on.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

#: "egress": kernels reach the public internet; "none": no network.
Network = Literal["none", "egress"]
#: What a suspend does with a cell still running: wait for it (up to
#: ``busy_timeout_s``, then interrupt), or interrupt it at once.
OnBusy = Literal["wait", "interrupt"]
StopReason = Literal["cancel", "preempt", "stale"]
JobArg = str | int | float | bool


# --------------------------------------------------------------- runtimes
class KernelRef(BaseModel):
    """A kernel a runtime should run."""

    id: str
    name: str = "python3"


class RuntimeLimits(BaseModel):
    """A project's own kernel limits; an unset field takes the agent's default."""

    memory_bytes: int | None = Field(None, ge=0)
    cpus: float | None = Field(None, gt=0, le=1024)
    pids: int | None = Field(None, ge=0)
    disk_bytes: int | None = Field(None, ge=0)


class EnsureRuntime(BaseModel):
    """``PUT /agent/v1/runtimes/{workspace_id}``: make the runtime exist (idempotent)."""

    generation: int = Field(ge=1)
    kernels: list[KernelRef] = []
    #: kernel id -> the blob key of its last complete snapshot.
    snapshot: dict[str, str] = {}
    #: The blob key of the workspace's package layer.
    packages: str | None = None
    #: The project's own limits; unset fields take the agent's defaults.
    limits: RuntimeLimits | None = None
    network: Network = "none"
    #: GPUs the workspace asks for: its kernels' sandbox binds the host's GPU device
    #: nodes (none without; each cell sees only its binding's through the CUDA env).
    gpus: int = Field(0, ge=0, le=64)
    #: kernel id -> what its notebook is told before its restore's own report (why
    #: it restarts here: its host was lost, and what that cost).
    notices: dict[str, str] = {}


class SuspendRuntime(BaseModel):
    """``POST /agent/v1/runtimes/{workspace_id}/suspend``: save, then release."""

    generation: int = Field(ge=1)
    on_busy: OnBusy = "wait"
    busy_timeout_s: float = Field(30.0, ge=0, le=3600)


class ReleaseRuntime(BaseModel):
    """``DELETE /agent/v1/runtimes/{workspace_id}``, as its query parameters."""

    generation: int = Field(ge=1)
    #: Copy the runtime's files back to the store before dropping it.
    sync: bool = True


class AddKernel(KernelRef):
    """``POST /agent/v1/runtimes/{workspace_id}/kernels``."""

    generation: int = Field(ge=1)
    #: ``KERNEL_*`` variables a gateway client asked for (``protocol.kernel_env``);
    #: the agent filters them again before the kernel gets them.
    env: dict[str, str] = Field(default_factory=dict)


class KernelModel(BaseModel):
    """An agent's view of one kernel (what every kernel call answers)."""

    id: str
    name: str
    workspace_id: str
    #: Jupyter's timestamp format (``2024-01-02T03:04:05.000006Z``), as its models use.
    last_activity: str
    #: Seconds since the last activity, on the agent's clock.
    idle_s: float
    execution_state: str
    #: Clients attached to the kernel's channels now.
    connections: int = Field(ge=0)
    #: Why the kernel last died by itself (a memory limit), if it did.
    last_death: str | None


class LostValue(BaseModel):
    """A variable a restore could not bring back: the name is not defined after it."""

    name: str
    type: str
    reason: str


class ChangedValue(BaseModel):
    """A variable that came back, but not as it was saved at suspend: the name is
    defined, with the value as it was loaded; ``reason`` says how it differs."""

    name: str
    type: str
    reason: str


class SettingState(BaseModel):
    """A kernel setting (environment variables, working directory, ``sys.path``,
    random state, ``In``/``Out``, matplotlib backend...) and whether it came back."""

    name: str
    status: Literal["restored", "lost"]
    #: Why it was lost (set only then).
    reason: str | None = None


class RestoreReport(BaseModel):
    """What restoring one kernel's snapshot brought back. ``restored`` names only
    values checked equal to those saved; one that came back different is in
    ``changed`` instead, never in both. Reports from agents older than ``changed``
    and ``settings`` lack them (those agents listed a changed value in ``lost``)."""

    #: "warm" (a pool kernel took the workspace) or "cold" (a kernel started for it).
    path: str
    restored: list[str] = []
    changed: list[ChangedValue] = []
    recomputed: list[str] = []
    lost: list[LostValue] = []
    settings: list[SettingState] = []
    #: The variables were not loaded (only the files came back); ``error`` says why.
    files_only: bool = False
    error: str | None = None
    #: The import statements replayed before the values were loaded.
    imports: list[str] = []
    #: Modules the warm kernel had imported before it was claimed: it was prepared
    #: with this workspace's imports (set only when there were any).
    prepared: list[str] = []
    #: Modules the kernel imported while its snapshot downloaded (set only then).
    preimported: list[str] = []
    #: The snapshot's size, when one was downloaded.
    bytes: int = Field(0, ge=0)
    seconds: float = Field(0.0, ge=0)
    #: The values were in the kernel's memory before the placement (a standby's,
    #: loaded after each cell): nothing was loaded when it was promoted.
    preloaded: bool = False


class LayerRestore(BaseModel):
    """Whether the workspace's package layer came back. Empty (``{}`` on the wire,
    ``restored`` False) when the runtime already existed: nothing was restored."""

    restored: bool = False
    error: str | None = None


class RuntimePlaced(BaseModel):
    """The answer to :class:`EnsureRuntime`.

    ``restore`` and ``packages`` are empty when the runtime already existed (an
    earlier attempt placed it): there was nothing to restore this time.

    The agent answers with the fields it set only (``exclude_unset``): a restore
    report carries ``bytes`` only when a snapshot was downloaded, ``imports`` only
    when the kernel reported them, and the control plane keeps the reports as
    they came (``model_dump(exclude_unset=True)``).
    """

    kernels: list[KernelModel]
    #: kernel id -> what its restore brought back.
    restore: dict[str, RestoreReport] = {}
    packages: LayerRestore = Field(default_factory=LayerRestore)


class SavedKernel(BaseModel):
    """One kernel's state as a suspend uploaded it."""

    key: str
    bytes: int = Field(ge=0)
    #: The bytes this upload wrote (the rest was already in the store).
    written: int = Field(ge=0)


class SavedSnapshot(BaseModel):
    """What a suspend saved. A kernel that could not flush is missing from
    ``kernels``: it keeps its previous snapshot."""

    kernels: dict[str, SavedKernel]
    #: The blob key of the package layer (None: the layer was empty).
    packages: str | None
    bytes: int = Field(ge=0)
    #: Said to the user (a running cell was interrupted to suspend).
    notes: list[str] = []


class RuntimeSuspended(BaseModel):
    """The answer to :class:`SuspendRuntime`; ``released`` is False (and there is
    no snapshot) when the agent had no runtime for the workspace."""

    released: bool
    snapshot: SavedSnapshot | None


class RuntimeReleased(BaseModel):
    """The answer to :class:`ReleaseRuntime`; False when there was no runtime."""

    released: bool


class AgentHealth(BaseModel):
    agent_id: str
    boot_id: str


class ResizeWarmPool(BaseModel):
    """``PUT /agent/v1/warm-pool``: the scheduler's prewarm: keep at least
    ``target`` warm kernels (never fewer than the agent's own ``--warm-pool``)."""

    target: int = Field(ge=0, le=256)


class WarmPoolState(BaseModel):
    """The answer to :class:`ResizeWarmPool` and to ``GET /agent/v1/warm-pool``."""

    target: int = Field(ge=0)
    ready: int = Field(ge=0)
    #: Of ``ready``, kernels prepared with a suspended workspace's imports.
    prepared: int = Field(default=0, ge=0)


# ------------------------------------------------------------------- jobs
class StartJob(BaseModel):
    """``POST /agent/v1/jobs``: run one attempt (idempotent per job and attempt)."""

    job_id: str
    attempt: int = Field(ge=1)
    command: list[str] = Field(min_length=1)
    args: dict[str, JobArg] = {}
    gpu_indices: list[int] = []
    gpu_type: str = ""
    timeout_s: int = Field(gt=0)
    idle_timeout_s: int = Field(gt=0)
    memory_mb: int = Field(gt=0)
    kill_grace_s: float = Field(ge=0)
    blob_prefix: str


class StopJob(BaseModel):
    """``POST /agent/v1/jobs/{job_id}/stop``: SIGTERM now, SIGKILL after ``grace_s``."""

    attempt: int = Field(ge=1)
    reason: StopReason
    grace_s: float = Field(10.0, ge=0, le=3600)


class AttemptFacts(BaseModel):
    """How the agent saw an attempt's process end; the control plane classifies them."""

    seq: int = Field(ge=0)
    gpu_ms: int = Field(ge=0, le=10**15)
    exit_code: int | None = None
    signal: int | None = None
    #: Why the agent killed it (a stop's reason, a timeout, memory), if it did.
    killed_for: str | None = None
    launch_error: str | None = None
    output_tail: str = Field("", max_length=20000)
    result: list[dict[str, Any]] = Field(default_factory=list, max_length=1000)
    log_chunks: int = Field(0, ge=0)


class JobStatus(BaseModel):
    """The answer to :class:`StartJob`: the attempt as the agent knows it."""

    job_id: str
    attempt: int = Field(ge=1)
    state: Literal["running", "ended"]
    pid: int | None
    #: Set once the attempt ended (e.g. it could not launch).
    outcome_facts: AttemptFacts | None


class JobStopping(BaseModel):
    """The answer to :class:`StopJob`: True when a process is being stopped."""

    stopping: bool


class JobAttempt(BaseModel):
    """One attempt the agent still runs or still reports (``GET /agent/v1/jobs``)."""

    job_id: str
    attempt: int = Field(ge=1)
    state: Literal["running", "ended"]
    pid: int | None
    gpu_ms: int = Field(ge=0)
    seq: int = Field(ge=0)


# ------------------------------------------ agent -> control plane (/internal)
class Registration(BaseModel):
    """``POST /internal/agents``: a host (re)announces itself."""

    id: str
    url: str
    boot_id: str
    #: CPU, memory, GPUs, kernelspecs and isolation (``model.resources.inventory_from_json``).
    inventory: dict[str, Any]


class Registered(BaseModel):
    """The control plane's answer to :class:`Registration`."""

    blobs_url: str


class KernelDeath(BaseModel):
    workspace_id: str = Field(max_length=100)
    kernel_id: str = Field(max_length=100)
    reason: str = Field(max_length=1000)


class DrainRequest(BaseModel):
    """``POST /internal/agents/{agent_id}/drain``: a stopping agent asks to be
    drained. Its boot id says it is the host's current process, not an old one
    still draining after the host started again."""

    boot_id: str


class HeldRuntime(BaseModel):
    """A runtime an agent runs, as its heartbeat reports it."""

    workspace_id: str = Field(max_length=100)
    generation: int = Field(ge=1)
    #: Seconds since the blob store last held every file its kernels wrote (None:
    #: it holds them all as of the last sync): what losing the host now would lose.
    files_unsynced_s: float | None = Field(None, ge=0, le=1e9)


class Heartbeat(BaseModel):
    """``POST /internal/agents/{agent_id}/heartbeat``."""

    boot_id: str
    #: Kernels that died for a reason the agent knows (a memory limit) since the
    #: last heartbeat: each becomes its workspace's ``last_error``.
    kernel_deaths: list[KernelDeath] = Field(default=[], max_length=1000)
    #: The runtimes the agent runs, so that the reply can name those no longer
    #: placed on it (older agents send none, and are told of none).
    runtimes: list[HeldRuntime] = Field(default=[], max_length=10_000)
    #: How far behind the store are the runtimes whose files were all synced at
    #: their last round (about a sync interval): a host lost now loses what their
    #: kernels wrote in these last seconds.
    files_lag_s: float = Field(0.0, ge=0, le=1e9)
    #: Its disk is below the reserve it keeps for the platform: it refuses new
    #: workspaces, so placements go elsewhere (None: it has no disk quotas).
    disk_short: bool | None = None


class HeartbeatReply(BaseModel):
    """The control plane's answer to :class:`Heartbeat` (older control planes
    answer 204, with no body)."""

    #: After this long without a heartbeat the control plane may presume the host
    #: dead and place its workspaces elsewhere: the agent's lease on writing to the
    #: store on its own (``agent.livesync.Lease``).
    agent_timeout_s: float = Field(gt=0)
    #: Of the runtimes the heartbeat reported, the workspaces no longer placed on
    #: this agent (in another host's or boot's hands, or a newer placement's): the
    #: agent drops them without syncing their files back.
    stale: list[str] = []


class AttemptBeat(BaseModel):
    """One running attempt in a job heartbeat; usage is cumulative."""

    job_id: str
    attempt: int = Field(ge=1)
    seq: int = Field(ge=1)
    gpu_ms: int = Field(ge=0, le=10**15)
    progress: float | None = None
    log_chunks: int = Field(0, ge=0)


class JobHeartbeats(BaseModel):
    """``POST /internal/jobs/heartbeats``: every attempt an agent runs, at once."""

    agent_id: str
    boot_id: str
    attempts: list[AttemptBeat] = Field(max_length=10000)


class JobDirective(BaseModel):
    """What one attempt should do, as the control plane answers a job heartbeat."""

    job_id: str
    attempt: int
    action: Literal["continue", "stop"]
    reason: str | None = None
    grace_s: float = 0.0


class JobDirectives(BaseModel):
    """The control plane's answer to :class:`JobHeartbeats`."""

    directives: list[JobDirective] = []


class AttemptFinish(AttemptFacts):
    """``POST /internal/jobs/{job_id}/attempts/{attempt}/finish``."""

    agent_id: str
    boot_id: str


class AttemptFinished(BaseModel):
    """The control plane's answer to :class:`AttemptFinish`: the job's state after it
    (404 or 409 instead when the attempt is unknown or stale)."""

    job_id: str
    attempt: int
    state: str
