"""``DistTrainJob.status``: what the operator and the job agent report.

The operator owns phase, conditions, replicas, restarts, reforms and the directive it gives the agent
(``control``); the job agent owns progress (step, samples) and ``lastCheckpoint``. Both patch with merge
patches on disjoint fields. Keeping the reconcile memory (pending scale, backoff) here makes the operator
level-triggered: a restarted operator reads back everything it decided.
"""

from __future__ import annotations

import enum
from typing import Final, Optional

from pydantic import Field

from disttrain.api.control import DirectiveAction
from disttrain.api.goodput import GoodputStatus
from disttrain.api.nameset import PackedNames
from disttrain.api.reformphases import ReformPhases, WorkerStartup
from disttrain.api.spec import MAX_INFRASTRUCTURE_LOSSES_PER_HOUR, ContractModel
from disttrain.api.timestamps import Timestamp

AGENT_FIELDS: Final = (
    "step",
    "samplesConsumed",
    "worldSize",
    "plan",
    "rendezvousRound",
    "roundStartTime",
    "lastProgressTime",
    "samplesPerSecond",
    "loss",
    "lastCheckpoint",
    "workerFailure",
    "checkpointInterval",
    "silentNodes",
    "stalledNodes",
    "roundMembers",
    "workerStartup",
    "inPlaceFallback",
    "checkpointUpload",
    "storeRejections",
    "resumedFromStep",
    "resumedFromJobUid",
    "resumedFromMemory",
    "recoveryNote",
    "checkpointBlockedSeconds",
)
"""Wire names of the status fields the job agent owns; it writes no other, and the operator never writes these."""


class Phase(str, enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    REFORMING = "Reforming"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"

    @property
    def is_finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class Condition(ContractModel):
    type: str
    """Condition type, e.g. Created, Running, Reforming, Suspended, Succeeded, Failed."""
    status: str = Field(pattern=r"^(True|False|Unknown)$")
    """True, False or Unknown."""
    reason: str = ""
    """CamelCase reason of the last transition."""
    message: str = ""
    """Human-readable detail of the last transition."""
    last_transition_time: Optional[str] = None
    """RFC 3339 time the status last changed."""
    last_update_time: Optional[str] = None
    """RFC 3339 time the reason or message last changed (as a Deployment's conditions have it)."""


class RestartCounts(ContractModel):
    total: int = 0
    """Restarts made so far, one per incident (counted against restartPolicy.maxRestarts); an incident that finds
    the budget spent fails the job and is not counted."""
    by_reason: dict[str, int] = Field(default_factory=dict)
    """Restarts by reason (NodeLost, PodFailed, Evicted, ...)."""


class InfrastructureLossCounts(ContractModel):
    """Losses of infrastructure the job survived, counted apart from the restart budget (docs/operator.md,
    "Restart budget")."""

    total: int = 0
    """Infrastructure losses so far, one per incident, departing node or lost job agent (never charged to
    restartPolicy.maxRestarts); one that exceeded restartPolicy.maxInfrastructureLossesPerHour failed the job and is
    not counted."""
    by_reason: dict[str, int] = Field(default_factory=dict)
    """Losses by reason (NodeNotReady, HeartbeatLost, Evicted, PodDeleted, NodeDeparting, AgentRestarted, ...)."""
    recent: list[Timestamp] = Field(default_factory=list, max_length=MAX_INFRASTRUCTURE_LOSSES_PER_HOUR)
    """Operator memory: RFC 3339 times of the losses within the last hour, oldest first (the window that
    restartPolicy.maxInfrastructureLossesPerHour bounds)."""


class CheckpointRef(ContractModel):
    step: int
    """Optimizer step of the newest complete checkpoint."""
    samples: int = 0
    """Samples consumed at that step."""
    path: str = ""
    """Directory of the checkpoint."""
    time: Optional[Timestamp] = None
    """RFC 3339 time it was committed."""
    world_size: int = 0
    """World size that wrote it."""


class PlanStatus(ContractModel):
    world_size: int
    """Processes in the current group."""
    global_batch: int
    """Samples per optimizer step."""
    micro_batch: int
    """Samples per process per forward/backward pass."""
    accum_steps: int
    """Gradient-accumulation steps per optimizer step."""
    lr_scale: float
    """Factor applied to lr.base for this world size (target of the ramp)."""


class ReformRecord(ContractModel):
    reason: str
    """Why the group was reformed: NodeLost, ScaleDown, ScaleUp, AgentRestarted, ..."""
    from_: int = Field(0, alias="from")
    """World size before."""
    to: int = 0
    """World size after (0 while the reform is in progress)."""
    start: Optional[Timestamp] = None
    """RFC 3339 time the reform began."""
    duration_seconds: Optional[float] = None
    """Seconds from the start to the first completed step at the new size."""
    phases: Optional[ReformPhases] = None
    """Where those seconds went, per phase (see ``disttrain.api.reformphases``), from the first sign of the loss."""
    resumed_from: Optional[str] = Field(None, max_length=16)
    """Where the new group took its state from: ``memory`` (its members' memory, nothing redone) or ``checkpoint``
    (the newest complete one; ``note`` says why an in-place reform could not use memory)."""
    note: Optional[str] = Field(None, max_length=512)


class ControlDirective(ContractModel):
    """What the operator asks of the job agent, which passes it to the workers through its store."""

    generation: int = 0
    """Increases with every new directive; workers act on each generation once."""
    action: DirectiveAction = DirectiveAction.NONE
    """none, drain (checkpoint at the next step boundary, then exit) or reform (exit at once)."""
    reason: str = ""
    """Why, e.g. ScaleDown, ScaleUp, NodeLost."""
    target_nodes: int = 0
    """Node count the next rendezvous round should complete with."""
    issued_at: Optional[Timestamp] = None
    """RFC 3339 time the directive was issued."""
    issued_round: Optional[int] = None
    """status.rendezvousRound when the directive was issued. The directive completes only once the agent reports
    a newer round at the target size: progress of the old group (which keeps stepping for a moment after the
    directive) never completes it."""
    exclude: list[str] = Field(default_factory=list)
    """Worker pods that must not join the next rendezvous round (scale-down victims being drained)."""
    lost: list[str] = Field(default_factory=list, max_length=1024)
    """Worker pods declared lost that still exist (a dead node's pod lingers Terminating): the survivors drop them
    from the finished rendezvous round at once, instead of waiting for their heartbeats to expire."""

    @property
    def in_flight(self) -> bool:
        """A drain or reform was issued and the group has not re-formed yet."""
        return self.action is not DirectiveAction.NONE


class WorkerFailureStatus(ContractModel):
    """A worker's own report of a failure (relayed by the job agent), seen even when torchrun hides exit codes."""

    exit_code: int
    """The trainer process's exit code (85 = permanent user error)."""
    node: str = ""
    """DISTTRAIN_NODE_NAME of the reporting node."""
    message: str = ""
    """What went wrong, in the trainer's words."""
    time: Optional[Timestamp] = None
    """RFC 3339 time of the report."""


class CheckpointIntervalStatus(ContractModel):
    """The interval `spec.checkpoint.intervalSteps: auto` chose (relayed by the job agent from rank 0)."""

    steps: int = Field(ge=1)
    """Optimizer steps between two saves: Young/Daly sqrt(2 x saveSeconds x mtbfSeconds) / stepSeconds, bounded."""
    save_seconds: float = Field(ge=0)
    """Seconds the newest save stopped training (its blocking part)."""
    step_seconds: float = Field(ge=0)
    """Seconds of one optimizer step."""
    mtbf_seconds: float = Field(ge=0)
    """Mean time between failures: running time / failures (status.restarts.total and the infrastructure losses
    that redo steps; a prior while there is none)."""
    failures: int = Field(0, ge=0)
    """Failures the estimate counted."""
    time: Optional[str] = None
    """RFC 3339 time of the choice."""


class SilentNode(ContractModel):
    """A worker node the job agent found silent in the rendezvous heartbeats (the operator treats it as lost)."""

    node: str = Field(max_length=253)
    """DISTTRAIN_NODE_NAME (the worker pod's name)."""
    pod_uid: str = Field("", max_length=64)
    """The pod's uid; a pod of the same name with another uid (a replacement) is not the silent one."""
    last_heartbeat: Optional[str] = None
    """RFC 3339 time of its last heartbeat (the worker's clock)."""


class StalledNode(ContractModel):
    """A worker node whose ranks did not reach a step's gradient reduction while their peers waited there (the
    job agent's stall rule, ``spec.elastic.stallFactor``); the operator evicts it as a lost node."""

    node: str = Field(max_length=253)
    """DISTTRAIN_NODE_NAME (the worker pod's name)."""
    pod_uid: str = Field("", max_length=64)
    """The pod's uid; a pod of the same name with another uid (a replacement) is not the stalled one."""
    ranks: list[int] = Field(default_factory=list, max_length=1024)
    """Its global ranks that lag."""
    step: int = Field(0, ge=0)
    """The step whose gradient reduction its peers wait at."""
    waited_seconds: float = Field(0.0, ge=0)
    """How long the first peer had waited there when the stall was found."""
    diagnostics: Optional[str] = Field(None, max_length=1024)
    """Where every rank writes its stacks (and NCCL's flight-recorder trace) for this stall."""


STORE_KEY_CLASSES: Final = ("rendezvous", "control", "torch", "foreign")
"""Classes of store keys the job agent reports rejections for: ``rendezvous`` (torchrun's rendezvous state and
per-round keys), ``control`` (``disttrain/*``), ``torch`` (any other key in the job's namespace), ``foreign`` (a key
outside it). A closed set: the metric's ``key_class`` label."""
STORE_REJECT_REASONS: Final = ("foreign", "unsigned", "replayed", "deleted")
"""Why the job agent rejected a store value: a key outside the namespace (deleted unread), not a valid envelope for
this key and job, a valid value older than one already seen, a valid value deleted. The metric's ``reason``."""


class StoreRejection(ContractModel):
    """One store value the job agent rejected (the newest rejection of that key)."""

    key: str = Field(max_length=128)
    """The key as the agent shows it: the job's namespace prefix as ``~/``, escaped, truncated."""
    key_class: str = Field(max_length=16)
    """rendezvous, control, torch or foreign (:data:`disttrain.trainer.agent.guardian.KEY_CLASSES`)."""
    reason: str = Field(max_length=16)
    """foreign, unsigned, replayed or deleted (:data:`disttrain.trainer.agent.guardian.REASONS`)."""
    time: Optional[Timestamp] = None
    """RFC 3339 time of the rejection (the agent's clock)."""


class StoreRejections(ContractModel):
    """What the job agent's store guardian rejected since the agent started
    (:mod:`disttrain.trainer.agent.guardian`)."""

    total: int = 0
    """Values rejected so far (keys deleted unread, unsigned or replayed values, valid values deleted)."""
    counts: dict[str, int] = Field(default_factory=dict, max_length=32)
    """Rejections by ``<key class>/<reason>`` (both from closed sets)."""
    recent: list[StoreRejection] = Field(default_factory=list, max_length=8)
    """The most recently rejected distinct keys, newest first."""


class Incident(ContractModel):
    """One unplanned loss and the losses it brought with it, charged once: one restart, or one infrastructure loss
    (docs/operator.md, "Restart budget"). A dead node takes its peers' workers with it (NCCL's watchdog aborts them),
    and a crash at start fails every node at once: each is one incident, not one charge per pod."""

    opened_at: Timestamp
    """RFC 3339 time of the loss that opened it."""
    reason: str
    """Its cause, the ``byReason`` key it was charged to (of ``status.restarts``, or of
    ``status.infrastructureLosses`` when ``infrastructure``): PodFailed, NodeNotReady, HeartbeatLost,
    ..., or NodeLost when the first loss seen was an exit that a peer's loss explains (SIGABRT, the reform exit 84, an
    NCCL or collective-timeout message); AgentRestarted for an uncharged one (``charged``)."""
    first_pod: str
    """The pod whose loss opened it."""
    infrastructure: bool = False
    """Charged to ``status.infrastructureLosses``, not to the restart budget: its cause is a loss of infrastructure
    (a node's, an eviction, a deletion). A failure of the user's code folded into it later moves it to the
    restart budget."""
    charged: bool = True
    """Whether it was charged at all. False for worker pods that failed because the job agent was lost (a
    torchrun caught inside a rendezvous join when its store vanished): they are replaced and the group re-formed as
    for any loss; the agent's loss itself is counted once, as an infrastructure loss, when it is seen."""
    covers: PackedNames = Field(default_factory=set)
    """The worker pods that existed when it opened: a later loss of one of them is folded in. Pods the operator
    creates while it is open (the restart's replacements, even one that takes a covered pod's freed name) leave it,
    so a replacement that fails is a new incident: a crash loop is charged once per retry that happened."""
    folded: PackedNames = Field(default_factory=set)
    """The pods folded in so far: each replaced, none charged again."""


class PendingScale(ContractModel):
    replicas: int
    """Requested node count (after clamping)."""
    since: str
    """RFC 3339 time the request was first seen; it acts after elastic.scaleDebounceSeconds."""


class DistTrainJobStatus(ContractModel):
    phase: Phase = Phase.PENDING
    """Pending, Running, Reforming, Succeeded, Failed or Suspended."""
    message: str = ""
    """Human-readable summary of the current phase."""
    conditions: list[Condition] = Field(default_factory=list)
    """Latest observations of the job's state, one per type."""
    replicas: int = 0
    """Worker pods that exist (scale subresource's status replicas)."""
    ready_replicas: int = 0
    """Worker pods running and ready."""
    selector: str = ""
    """Label selector of the worker pods (scale subresource, used by an HPA)."""
    desired_nodes: int = 0
    """Node count the operator is working towards (spec.nodes.replicas clamped, limited to valid sizes)."""
    world_size: int = 0
    """Processes in the current group."""
    world: str = ""
    """World size of the running group / the desired world size (desired nodes x nprocPerNode), e.g. `6/8`:
    the WORLD column of `kubectl get`."""
    samples_per_second: Optional[float] = None
    """Global training throughput at the newest progress report (the job agent relays rank 0's figure)."""
    loss: Optional[float] = None
    """The global, token-weighted loss of the newest reported step: the sum of every rank's summed loss over the
    step's denominator (docs/trainer.md, "The loss contract"); absent when the value is not finite."""
    rendezvous_round: int = 0
    """Completed rendezvous rounds (counted by the job agent: a new group's first progress report bumps it)."""
    round_start_time: Optional[Timestamp] = None
    """RFC 3339 time of the current round's first progress report (the new group's first completed step)."""
    restarts: RestartCounts = Field(default_factory=RestartCounts)
    """Failures of the job's own code restarted, total and by reason."""
    infrastructure_losses: InfrastructureLossCounts = Field(default_factory=InfrastructureLossCounts)
    """Losses of infrastructure the job survived (not charged to the restart budget), total, by reason and the
    last hour's."""
    reforms: int = 0
    """Times the group was reformed (planned and unplanned)."""
    stalls: int = 0
    """Stalled nodes evicted (each pod counted once; ``disttrain_stalls_total``)."""
    last_checkpoint: Optional[CheckpointRef] = None
    """Newest complete checkpoint."""
    plan: Optional[PlanStatus] = None
    """Batch and LR plan for the current world size."""
    step: int = 0
    """Last completed optimizer step."""
    samples_consumed: int = 0
    """Samples consumed up to that step."""
    last_reform: Optional[ReformRecord] = None
    """The most recent reform."""
    control: ControlDirective = Field(default_factory=ControlDirective)
    """The operator's current directive to the job agent."""
    pending_scale: Optional[PendingScale] = None
    """A scale request waiting out the debounce."""
    next_restart_time: Optional[Timestamp] = None
    """RFC 3339 time before which no failed node is restarted (backoff)."""
    start_time: Optional[Timestamp] = None
    """RFC 3339 time the job first ran."""
    suspended_seconds: float = Field(0.0, ge=0)
    """Seconds the job spent suspended since startTime; runPolicy.activeDeadlineSeconds does not count them."""
    suspended_since: Optional[Timestamp] = None
    """RFC 3339 time the current suspension began (unset while not suspended)."""
    completion_time: Optional[Timestamp] = None
    """RFC 3339 time the job succeeded or failed."""
    observed_generation: int = 0
    """metadata.generation the operator last acted on."""
    last_progress_time: Optional[Timestamp] = None
    """RFC 3339 time of the newest trainer progress report relayed by the job agent."""
    agent_lost_at: Optional[Timestamp] = None
    """RFC 3339 time the job agent was last lost, until the workers report progress through its replacement: a
    worker pod that existed then and fails meanwhile (a torchrun inside a rendezvous join exits when its store
    disappears) is replaced in an uncharged incident (AgentRestarted), not charged as a PodFailed. The agent's loss
    itself is no restart: the workers train on and reconnect to the new agent behind the same Service name."""
    worker_failure: Optional[WorkerFailureStatus] = None
    """The newest failure a worker reported through the job agent (e.g. a permanent user error)."""
    checkpoint_interval: Optional[CheckpointIntervalStatus] = None
    """The checkpoint interval chosen by `spec.checkpoint.intervalSteps: auto`, and its inputs."""
    silent_nodes: Optional[list[SilentNode]] = Field(None, max_length=1024)
    """Worker nodes silent in the rendezvous heartbeats for keepAliveMaxAttempts x keepAliveIntervalSeconds, as
    the job agent sees them (unset when none): the operator reforms without them before Kubernetes notices."""
    stalled_nodes: Optional[list[StalledNode]] = Field(None, max_length=1024)
    """Worker nodes behind a stalled step, as the job agent sees them (unset when none): the operator evicts them
    and the group re-forms without them."""
    round_members: Optional[list[str]] = Field(None, max_length=1024)
    """The worker pods in the completed rendezvous round, as the job agent reads them from the rendezvous state
    (unset before the first round). A pod not named here while the group runs is waiting outside it (a hot spare,
    a newcomer): losing it costs the group nothing, so the operator replaces it without a reform."""
    worker_startup: Optional[WorkerStartup] = None
    """When the current group's rank 0 started, phase by phase, and when the previous group exited (relayed by
    the job agent); the operator computes ``lastReform.phases`` from it."""
    resumed_from_step: Optional[int] = Field(None, ge=0)
    """The checkpoint step the current group loaded when it started (relayed by the job agent from rank 0); unset
    when it started without one. It can be older than ``lastCheckpoint`` when the newest checkpoint could not be
    loaded."""
    resumed_from_job_uid: Optional[str] = Field(None, max_length=64)
    """metadata.uid of the job that wrote that checkpoint, when rank 0 knows it. Another uid than this job's means
    the checkpoints are an earlier job's of the same name (deleted and created again): its training goes on
    (docs/operator.md, "Starting afresh")."""
    resumed_from_memory: Optional[bool] = None
    """The current group, re-formed in place, took its state from its members' memory (True) or loaded its newest
    complete checkpoint (False; ``recoveryNote`` says why); unset for a group that did not reform in place."""
    recovery_note: Optional[str] = Field(None, max_length=512)
    """Why the current group loaded its checkpoint although it reforms in place (relayed by the job agent)."""
    in_place_fallback: Optional[str] = Field(None, max_length=512)
    """Why a reform restarts the current group's workers from the last checkpoint although
    ``spec.elastic.reformInPlace`` asks to keep them (relayed by the job agent from rank 0); unset while in-place
    reform applies or was not asked for."""
    checkpoint_upload: Optional[str] = Field(None, max_length=512)
    """With ``checkpoint.uri``: saves committed on the workers' local disks and not yet COMPLETE in the bucket, and
    the last error while uploading or publishing them (relayed by the job agent from rank 0); unset while the bucket
    keeps up. ``lastCheckpoint`` is the newest save COMPLETE in the bucket."""
    store_rejections: Optional[StoreRejections] = None
    """Values the job agent found invalid in its store and removed or repaired (unset while there were none): a
    sign that something without the job's secret writes to the store."""
    tracked_pods: PackedNames = Field(default_factory=set)
    """Operator memory: pods seen alive (the job agent and workers); one that vanishes from here was lost. Packed
    (``<job>-worker-[0-9999]``, :mod:`disttrain.api.nameset`) so 10,000 nodes take a few bytes, not 670 KB; the
    older ``name -> uid`` map is still read."""
    handled_pods: list[str] = Field(default_factory=list)
    """Operator memory: uids of lost pods already counted, so a restarted operator never counts one twice."""
    last_failure: Optional[str] = Field(None, max_length=1024)
    """The newest failure counted as a restart: which pod, why, its exit code and the last line of the user's
    traceback (from the trainer container's termination message)."""
    pod_group_min_member: int = Field(0, ge=0)
    """Operator memory: the minMember last written to the job's PodGroup (spec.gang); 0: none written yet."""
    consecutive_failures: int = Field(0, ge=0)
    """Failures since training last progressed; the restart backoff doubles with each."""
    incident: Optional[Incident] = None
    """Operator memory: the unplanned loss being handled, from its first loss until a group runs again (unset
    otherwise, and once the job finished). Losses of the pods it covers are folded into it, not charged again."""
    checkpoint_blocked_seconds: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    """Seconds the current group's rank 0 waited for checkpoint saves since it started (relayed by the job agent)."""
    goodput: Optional[GoodputStatus] = None
    """Where the job's wall time went: seconds by cause and the training ratio (docs/observability.md, "Goodput by
    cause"). Written with the operator's other status writes, and at least every few minutes."""
