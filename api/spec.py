"""``DistTrainJob.spec``: the single source of truth for the custom resource.

The CRD's OpenAPI schema (with every field's docstring as its description), its defaults and enums are
rendered from these models by :mod:`disttrain.api.crd`. Field names are camelCase on the wire (aliases) and
snake_case in Python. Cross-field rules live in :mod:`disttrain.api.rules` so that the CRD's CEL and
``disttrain validate`` share one definition.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel

from disttrain.api import constants, containers, storageuri
from disttrain.api.exitcodes import DEFAULT_PERMANENT_EXIT_CODES


class ContractModel(BaseModel):
    """Base for every wire model: camelCase names, unknown fields refused (as ``kubectl`` strict decoding does)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict as it appears in a manifest (camelCase, unset optionals omitted)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class BatchPolicy(str, enum.Enum):
    FIXED = "fixed"
    SCALED = "scaled"


class GradientReduction(str, enum.Enum):
    DDP = "ddp"
    ORDERED = "ordered"


class LRScaling(str, enum.Enum):
    LINEAR = "linear"
    SQRT = "sqrt"
    NONE = "none"


class LRSchedule(str, enum.Enum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class SuccessPolicy(str, enum.Enum):
    ALL_WORKERS = "AllWorkers"
    RANK_ZERO = "RankZero"


class CleanPodPolicy(str, enum.Enum):
    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class NodesSpec(ContractModel):
    min: int = Field(1, ge=1, le=10_000)
    """Fewest nodes (pods) the job may run with. Below this, the job waits for replacements instead of training."""
    max: int = Field(ge=1, le=10_000)
    """Most nodes the job may run with; scale requests above it are clamped."""
    replicas: int = Field(ge=1, le=10_000)
    """Desired node count; the scale subresource (`kubectl scale`, HPA) writes this field."""
    spares: int = Field(0, ge=0, le=100)
    """Hot spares: worker pods kept running beyond the group, warm (imports done) and waiting in the rendezvous.
    A lost node's place is taken by a spare at once, so the reform never waits for a replacement pod to be
    created, scheduled, pulled and started; the replacement becomes the next spare. Each spare holds a node's
    resources while it waits. Not part of the world size: `replicas` and the scale subresource count without them."""


DEFAULT_SILENCE_S = 1.0
"""TorchFT's lighthouse declares a replica dead after 1 s without its 100 ms heartbeats; the agent does the same."""
BEAT_INTERVAL_S = 0.1
"""Period of each node's liveness beat to the job agent (`spec.rendezvous.silentAfterSeconds`), up to
:data:`AGENT_BEATS_PER_S` nodes."""
AGENT_BEATS_PER_S = 4096.0
"""Beats a second that one job's nodes send its agent together at most, as long as the silence allows: each is a
signed write through the agent's front, which passes every request in Python."""
BEATS_PER_SILENCE = 4
"""Beats a node sends within ``silentAfterSeconds`` at least: one late beat never makes a live node silent."""


def beat_interval_seconds(max_nodes: int, silence_s: float = DEFAULT_SILENCE_S) -> float:
    """The period of each node's beat in a job of up to ``max_nodes`` nodes: :data:`BEAT_INTERVAL_S`, or longer in
    a job so large that its beats would pass :data:`AGENT_BEATS_PER_S`, but never longer than the silence allows
    (1,024 nodes with the default silence of 1 s: every 0.25 s)."""
    spread = max_nodes / AGENT_BEATS_PER_S
    return max(BEAT_INTERVAL_S, min(spread, silence_s / BEATS_PER_SILENCE))


class RendezvousSpec(ContractModel):
    port: int = Field(29400, ge=1, le=65535)
    """TCP port of the c10d rendezvous store hosted by the job agent."""
    join_timeout_seconds: int = Field(600, ge=1, le=86_400)
    """How long a node waits for a rendezvous round to complete before giving up (torchrun join_timeout)."""
    last_call_timeout_seconds: int = Field(30, ge=0, le=3_600)
    """Extra wait for more nodes once the minimum has joined (torchrun last_call_timeout). While the job agent
    publishes the operator's target node count (always, once it runs), a round completes as soon as the target
    joined and never with fewer nodes, so this wait plays no part. It matters only when no target is published
    (a store without the agent's keys, stock c10d), where a short wait lets a round complete with the first
    min nodes while others are still starting: a second reform, or two groups side by side. Hence torch's
    own default, 30."""
    close_timeout_seconds: int = Field(10, ge=1, le=3_600)
    """Time to wait for a closed rendezvous to be noticed by all nodes (torchrun close_timeout)."""
    keep_alive_interval_seconds: int = Field(1, ge=1, le=600)
    """Heartbeat period of each node in the rendezvous (torchrun keep_alive_interval). Each is a compare-and-set of
    the whole rendezvous state in the agent's store, so it stays at seconds: the job agent's silence rule reads a
    lighter beat of its own (`silentAfterSeconds`)."""
    keep_alive_max_attempts: int = Field(3, ge=1, le=100)
    """Missed heartbeats after which torch itself drops a node from the rendezvous (torchrun
    keep_alive_max_attempt). Every node judges the others' heartbeats against its own clock here, so keep
    interval x attempts (torch's expiry, 3 s by default) at seconds: clock skew or a starved node must not split
    a round."""
    silent_after_seconds: float = Field(DEFAULT_SILENCE_S, ge=0.5, le=3_600)
    """Silence after which the job agent reports a node lost (`status.silentNodes`; the operator fences its pod and
    re-forms the group). Every node's launcher beats 10 times a second into the agent's store besides torch's
    heartbeats (in a job of more than 409 nodes less often, down to 4 beats per silence); a node whose beats are
    this far behind the newest beat of any node (compared with each other, never with a clock) in a round that
    has run unchanged for torch's expiry is silent; otherwise, at torch's expiry. At most keepAliveIntervalSeconds
    x keepAliveMaxAttempts."""


class LRSpec(ContractModel):
    base: float = Field(gt=0, le=1_000)
    """Learning rate at the reference batch size."""
    reference_batch_size: Optional[int] = Field(None, ge=1)
    """Global batch size for which `base` was tuned. Defaults to training.globalBatchSize."""
    scaling: LRScaling = LRScaling.LINEAR
    """How the LR follows the global batch: linear (x k), sqrt (x sqrt(k)) or none, with k = batch / reference."""
    ramp_steps: int = Field(0, ge=0, le=10_000_000)
    """Optimizer steps over which the LR factor moves linearly to a new value (at start and after every reform)."""
    schedule: LRSchedule = LRSchedule.CONSTANT
    """LR schedule over training progress (samples consumed / total samples): constant, cosine or linear decay."""
    warmup_samples: int = Field(0, ge=0)
    """Samples of linear warmup from 0 at the start of the schedule."""
    min_factor: float = Field(0.0, ge=0, le=1)
    """Floor of the decaying schedules, as a fraction of the base LR."""


class MeshSpec(ContractModel):
    """A 2-D device mesh: a fixed inner dimension of ``shard`` or ``tensorParallel`` ranks inside a node, and an
    elastic outer dimension of world size / inner degree groups that grows and shrinks with the node count
    (docs/trainer.md, "Meshes"). Exactly one of shard and tensorParallel; it must divide nprocPerNode, so every
    world size of the node range splits into whole groups and no group spans two nodes."""

    shard: Optional[int] = Field(None, ge=1, le=1_024)
    """HSDP: parameters, gradients and optimizer state are sharded over groups of this many ranks and replicated
    across the groups (the elastic dimension). Every rank reads its own samples. Needs the trainer's parallelism
    fsdp2."""
    tensor_parallel: Optional[int] = Field(None, ge=1, le=1_024)
    """FSDP x TP: the layers of the script's TP plan are split over groups of this many ranks, which read the same
    samples; FSDP2 shards over the elastic data dimension (world size / this). Batch, accumulation and LR rules see
    the data degree. Needs the trainer's parallelism fsdp2 and a tp_plan."""

    @property
    def inner_degree(self) -> int:
        """Ranks in the fixed inner dimension (1: a 1-D mesh)."""
        return self.tensor_parallel or self.shard or 1


def data_degree(ranks: int, tensor_parallel: Optional[int]) -> int:
    """The data degree: how many of ``ranks`` read different samples. The ranks of a tensor-parallel group read the
    same samples, so it is ``ranks / tensorParallel`` on an FSDP x TP mesh and every rank otherwise (HSDP, 1-D).
    The one definition: the batch plan, the admission rule (per node) and the trainer's mesh layout use it."""
    return ranks // tensor_parallel if tensor_parallel else ranks


class TrainingSpec(ContractModel):
    global_batch_size: int = Field(ge=1, le=100_000_000)
    """Samples per optimizer step. In fixed mode the exact global batch at every world size; in scaled mode the
    reference for LR scaling when lr.referenceBatchSize is unset."""
    micro_batch_size: int = Field(ge=1, le=1_000_000)
    """Samples per process per forward/backward pass."""
    batch_policy: BatchPolicy = BatchPolicy.FIXED
    """fixed: keep the global batch, gradient accumulation absorbs the world size (must divide it).
    scaled: keep the per-process batch (micro x accumulationSteps), the global batch grows with the world."""
    accumulation_steps: int = Field(1, ge=1, le=100_000)
    """Gradient-accumulation steps per optimizer step in scaled mode (fixed mode computes its own)."""
    lr: LRSpec
    """Learning rate and how it reacts to the world size."""
    max_steps: Optional[int] = Field(None, ge=1)
    """Stop after this many optimizer steps. Exactly one of maxSteps and maxSamples."""
    max_samples: Optional[int] = Field(None, ge=1)
    """Stop after this many samples. Exactly one of maxSteps and maxSamples."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of the data permutation and of model randomness (dropout is keyed by sample and step, never by rank)."""
    gradient_reduction: GradientReduction = GradientReduction.DDP
    """ddp: DistributedDataParallel's all-reduce. A recovery at the same world size is bitwise exact; after a
    world-size change the sum runs in another order (drift measured in docs/trainer.md). ordered: each micro
    batch's gradient is kept apart and the step's gradient is their sum in a fixed order of micro-batch index,
    the same at every world size, so in fixed mode a resume at another world size is bitwise exact too. Needs
    the trainer's parallelism ddp in fp32; costs memory (2 x accumulation steps x parameters) and
    communication that grow with gradient accumulation (docs/trainer.md)."""
    mesh: Optional[MeshSpec] = None
    """A 2-D device mesh with the node count as its elastic outer dimension (HSDP or FSDP x TP); unset: the 1-D
    mesh of the trainer's parallelism."""
    deterministic: bool = False
    """true: torch's deterministic algorithms (torch.use_deterministic_algorithms) and cuBLAS's fixed workspace
    (CUBLAS_WORKSPACE_CONFIG=:4096:8 in the trainer container's env, unless it sets its own), so a run on GPUs
    gives the same bits at the same world size. Slower, and an op without a deterministic kernel raises
    (docs/gpu.md); on the CPU it changes next to nothing."""

    @property
    def reference_batch(self) -> int:
        """The batch size the base LR refers to."""
        return self.lr.reference_batch_size or self.global_batch_size

    def is_complete(self, step: int, samples_consumed: int) -> bool:
        """Training reached its length: maxSteps optimizer steps, or maxSamples samples."""
        if self.max_steps is not None:
            return step >= self.max_steps
        return self.max_samples is not None and samples_consumed >= self.max_samples

    @property
    def total_samples(self) -> int:
        """Length of the run in samples; the LR schedule is evaluated on samples, so it never depends on the world."""
        if self.max_samples is not None:
            return self.max_samples
        assert self.max_steps is not None
        return self.max_steps * self.global_batch_size


class S3AddressingStyle(str, enum.Enum):
    AUTO = "auto"
    PATH = "path"
    VIRTUAL = "virtual"


class S3Options(ContractModel):
    """How the workers reach the bucket of ``checkpoint.uri``."""

    endpoint: Optional[str] = Field(None, min_length=1, max_length=1024, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
    """URL of an S3-compatible store (MinIO, Ceph RGW, a cloud's S3 interface); unset: AWS S3 of `region`."""
    region: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")
    """Region of the bucket; unset: the worker's environment (AWS_REGION, AWS_DEFAULT_REGION) decides."""
    addressing_style: S3AddressingStyle = S3AddressingStyle.AUTO
    """path (https://endpoint/bucket/key, what most S3-compatible stores need), virtual (https://bucket.endpoint/key)
    or auto (the SDK chooses)."""
    credentials_secret: Optional[str] = Field(
        None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
    )
    """Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally
    AWS_SESSION_TOKEN), given to the trainer container as environment variables. Unset: the worker pod's own
    identity (its environment, an IRSA-style web identity token, the node's instance role); never the operator's."""


class CheckpointSpec(ContractModel):
    claim_name: Optional[str] = Field(None, min_length=1, max_length=253)
    """PersistentVolumeClaim (ReadWriteMany for several nodes) mounted at `path`. Exactly one of claimName,
    volumeName and uri."""
    volume_name: Optional[str] = Field(None, min_length=1, max_length=63)
    """Name of a volume declared in the pod template, mounted at `path`. Exactly one of claimName, volumeName and
    uri."""
    uri: Optional[str] = Field(None, min_length=1, max_length=storageuri.MAX_URI_LENGTH)
    """Object store location s3://BUCKET/PREFIX (AWS S3 or an S3-compatible store, see `s3`). A save goes to a
    local tier at `path` first (an emptyDir) and is uploaded in the background; a checkpoint is complete once every
    object is in the bucket and verified. Exactly one of claimName, volumeName and uri."""
    s3: Optional[S3Options] = None
    """Endpoint, region, addressing style and credentials of the bucket of `uri` (only with uri)."""
    local_tier_size_limit: Optional[str] = Field(
        None, max_length=64, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
    )
    """sizeLimit of the emptyDir that holds the local tier (a quantity such as 200Gi; only with uri). Local copies
    are kept until uploaded, so it bounds what an unreachable bucket can pile up. Unset: no limit."""
    path: str = Field("/var/lib/disttrain/checkpoints", min_length=1, max_length=4096, pattern=r"^/")
    """Absolute mount path in the trainer container; checkpoints go to <path>/<namespace>/<job name>. With uri,
    the local tier's mount path."""
    interval_steps: Optional[Union[int, Literal["auto"]]] = Field(
        100, json_schema_extra={"x-kubernetes-int-or-string": True, "minimum": 1, "pattern": "^auto$"}
    )
    """Save every this many optimizer steps, or `auto`: the Young/Daly optimum sqrt(2 x save cost x MTBF) from the
    measured save cost, step time and the job's failures so far, re-estimated as the job runs (see
    docs/trainer.md). At least one of intervalSteps and intervalSeconds."""
    interval_seconds: Optional[int] = Field(None, ge=1)
    """Save when this many seconds passed since the last save (checked at step boundaries)."""
    keep: int = Field(3, ge=1, le=1_000)
    """Complete checkpoints kept; the newest complete one and a save in flight are never deleted."""
    async_save: bool = Field(False, alias="async")
    """Write in the background (dcp.async_save); training blocks only for the in-memory staging copy."""
    termination_grace_period_seconds: Optional[int] = Field(None, ge=1, le=86_400)
    """terminationGracePeriodSeconds of the worker pods: the seconds a worker gets between SIGTERM (eviction,
    preemption, deletion) and SIGKILL. A worker spends them on a checkpoint (it finishes its step, saves, exits),
    so the value is sized by the checkpoint, hence its place here. Unset: elastic.drainTimeoutSeconds, or twice
    the measured step plus save seconds when longer (status.checkpointInterval, sync saves only; see
    disttrain.operator.graceperiod). A template that sets terminationGracePeriodSeconds itself wins."""

    @field_validator("interval_steps", mode="before")
    @classmethod
    def _int_or_auto(cls, value: Any) -> Any:
        """One clear message for both halves of the union (pydantic would report each branch)."""
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"intervalSteps must be an integer >= 1 or 'auto', got {value!r}")
        return value

    @field_validator("uri")
    @classmethod
    def _object_store_uri(cls, value: Optional[str]) -> Optional[str]:
        problem = storageuri.uri_problem(value) if value is not None else ""
        if problem:
            raise ValueError(problem)
        return value

    @property
    def auto_interval(self) -> bool:
        """Whether the step interval is chosen by the trainer (:mod:`disttrain.api.interval`)."""
        return self.interval_steps == "auto"


DEFAULT_DEPARTURE_TAINTS: tuple[str, ...] = (
    "ToBeDeletedByClusterAutoscaler",
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "cloud.google.com/impending-node-termination",
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/scheduled-maintenance",
    "aws-node-termination-handler/asg-lifecycle-termination",
)
"""Taints that announce a node's end: the cluster autoscaler's and Karpenter's scale-in, GKE's graceful node shutdown,
and AWS Node Termination Handler's spot interruption, maintenance and scale-in notices."""

_QUALIFIED_NAME = r"^[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?$"
TaintKey = Annotated[str, Field(min_length=1, max_length=317, pattern=_QUALIFIED_NAME)]
NodeConditionType = Annotated[str, Field(min_length=1, max_length=316, pattern=_QUALIFIED_NAME)]


class DepartureSpec(ContractModel):
    """What announces that a worker's node is about to go. A worker on such a node is drained off it at the next
    step boundary (a checkpoint, then the group re-forms without it) and replaced elsewhere: no step is lost and no
    restart is charged. A node that is already NotReady or gone is a loss, not a departure."""

    on_cordon: bool = True
    """A cordoned node (spec.unschedulable: ``kubectl cordon``, the first half of ``kubectl drain``) is leaving."""
    taints: list[TaintKey] = Field(default_factory=lambda: list(DEFAULT_DEPARTURE_TAINTS), max_length=64)
    """Keys of NoSchedule or NoExecute taints that announce the node's end (spot and preemption notices, scale-in).
    Setting the list replaces the defaults."""
    conditions: list[NodeConditionType] = Field(default_factory=list, max_length=64)
    """Node condition types that announce the node's end when their status is True (for example a node problem
    detector's or a cloud's termination notice condition)."""


class ElasticSpec(ContractModel):
    scale_debounce_seconds: int = Field(10, ge=0, le=3_600)
    """A scale request must stand this long before pods are drained or added (absorbs HPA flapping)."""
    replacement_wait_seconds: Union[int, Literal["auto"]] = Field(
        "auto",
        json_schema_extra={"x-kubernetes-int-or-string": True, "minimum": 0, "maximum": 86_400, "pattern": "^auto$"},
    )
    """After an unplanned node loss, wait this long for a replacement before reforming with the survivors, or
    `auto`: wait a few seconds only where this job's pods start that fast, otherwise re-form at once and take the
    replacement in when it is Ready (disttrain.operator.replacement)."""
    drain_timeout_seconds: int = Field(120, ge=1, le=86_400)
    """How long a drain (checkpoint at the next step boundary, then exit) may take before pods are deleted."""
    stuck_pod_timeout_seconds: int = Field(300, ge=1, le=86_400)
    """A pod Terminating longer than this (e.g. on a dead node) is force-deleted."""
    pending_timeout_seconds: int = Field(600, ge=1, le=86_400)
    """A new pod Pending longer than this is given up on; the job continues at the size it has if >= nodes.min."""
    collective_timeout_seconds: int = Field(60, ge=1, le=86_400)
    """Timeout of one collective in the trainer's process group; a hung peer is detected after this long."""
    reform_in_place: bool = True
    """Survivors of a reform keep their worker processes: they re-join the next round in place, and the new group
    takes its state from the member that holds the newest step in memory (nothing since the last checkpoint is
    redone, no model is built again). DDP only: FSDP2 workers, and any worker whose collective fails outside the
    trainer's own calls, restart as when this is false."""
    stall_factor: float = Field(10.0, ge=0, le=1_000)
    """A step is stalled when some ranks have waited at its gradient reduction this many times the median step
    time while others have not reached it; the lagging nodes are named, their stacks dumped, and they are evicted
    (docs/gpu.md, "Stalled steps"). 0 turns the detection off."""
    stall_min_seconds: float = Field(60.0, ge=1, le=86_400)
    """The least wait that counts as a stall, whatever the median step time: a slow save or a warm-up step of a
    few seconds never does."""
    departure: DepartureSpec = Field(default_factory=DepartureSpec)
    """Node signals that drain a worker off its node before the node goes (``kubectl drain``, scale-in, spot)."""

    @field_validator("replacement_wait_seconds", mode="before")
    @classmethod
    def _seconds_or_auto(cls, value: Any) -> Any:
        """One clear message for both halves of the union (pydantic would report each branch)."""
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 86_400:
            raise ValueError(f"replacementWaitSeconds must be an integer from 0 to 86400 or 'auto', got {value!r}")
        return value


class ExitCodeClasses(ContractModel):
    permanent: list[int] = Field(default_factory=lambda: list(DEFAULT_PERMANENT_EXIT_CODES), max_length=64)
    """Exit codes that fail the job at once (user errors a restart cannot fix)."""
    retryable: list[int] = Field(default_factory=list, max_length=64)
    """Exit codes always retried within the restart budget. Codes in neither list are retried too."""


MAX_INFRASTRUCTURE_LOSSES_PER_HOUR = 1_000
"""The largest ``restartPolicy.maxInfrastructureLossesPerHour``: it bounds the loss times the status keeps."""


class RestartPolicySpec(ContractModel):
    max_restarts: int = Field(10, ge=0, le=100_000)
    """Restart budget: failures of the job's own code (a worker's exit code, a crash loop, a stalled step) tolerated
    before the job fails. Losses of infrastructure are not charged to it (maxInfrastructureLossesPerHour)."""
    max_infrastructure_losses_per_hour: int = Field(20, ge=1, le=MAX_INFRASTRUCTURE_LOSSES_PER_HOUR)
    """Guard against a flapping cluster: infrastructure losses the job survives within any hour (a node lost,
    NotReady or silent, a pod evicted, preempted or deleted, a node departing, the job agent lost;
    status.infrastructureLosses). Another within the hour fails the job (InfrastructureLossesExceeded). They are
    never charged to maxRestarts."""
    backoff_seconds: float = Field(5.0, ge=0, le=3_600)
    """Delay before the first restart after a failure; doubles with each consecutive failure."""
    max_backoff_seconds: float = Field(300.0, ge=0, le=86_400)
    """Cap of the restart delay."""
    exit_codes: ExitCodeClasses = Field(default_factory=ExitCodeClasses)
    """Which worker exit codes are permanent and which are retryable."""


class RunPolicySpec(ContractModel):
    suspend: bool = False
    """Suspended jobs have no pods; status and checkpoints are kept, and resuming continues from the last checkpoint."""
    ttl_seconds_after_finished: Optional[int] = Field(None, ge=0)
    """Delete the job this long after it succeeded or failed."""
    active_deadline_seconds: Optional[int] = Field(None, ge=1)
    """Fail the job when it has been running (since startTime) longer than this."""
    clean_pod_policy: CleanPodPolicy = CleanPodPolicy.ALL
    """Which pods to delete when the job finishes: All, Running (keep finished pods for their logs) or None."""
    scheduler_name: Optional[str] = Field(None, min_length=1, max_length=253)
    """Scheduler for the worker pods (e.g. a gang scheduler)."""
    priority_class_name: Optional[str] = Field(None, min_length=1, max_length=253)
    """PriorityClass of the worker pods."""


class GangScheduler(str, enum.Enum):
    VOLCANO = "volcano"
    SCHEDULER_PLUGINS = "scheduler-plugins"


class GangSpec(ContractModel):
    """Gang scheduling by a PodGroup: no worker pod is bound before nodes.min of them can be placed together."""

    scheduler: GangScheduler
    """volcano (PodGroup scheduling.volcano.sh/v1beta1, pod annotation scheduling.k8s.io/group-name) or
    scheduler-plugins (coscheduling: PodGroup scheduling.x-k8s.io/v1alpha1, pod label
    scheduling.x-k8s.io/pod-group). The operator creates the PodGroup (minMember = nodes.min) and keeps it in
    step with nodes.min; the scheduler itself is installed by the cluster's administrator."""
    scheduler_name: Optional[str] = Field(None, min_length=1, max_length=253)
    """schedulerName of the worker pods; default `volcano`, or `scheduler-plugins-scheduler` (the name the
    scheduler-plugins chart gives its second scheduler). runPolicy.schedulerName, when set, wins."""
    queue: Optional[str] = Field(None, min_length=1, max_length=253)
    """Volcano queue of the PodGroup (spec.queue); unset: Volcano's default queue. Volcano only."""
    schedule_timeout_seconds: Optional[int] = Field(None, ge=1, le=86_400)
    """How long the coscheduling plugin waits for the whole gang (PodGroup spec.scheduleTimeoutSeconds);
    unset: the plugin's default. scheduler-plugins only."""


class ReportingSpec(ContractModel):
    progress_interval_seconds: int = Field(60, ge=1, le=3_600)
    """Seconds between two progress writes of the job agent into the job's status (step, samples, progress time).
    What the operator acts on is written at once: a new rendezvous round, a checkpoint while a drain is in
    flight, a worker failure, the end of training. A routine checkpoint goes out with the next progress write.
    Every step in between is on the workers' /metrics. Bounds the agent's API writes to about 60 / this per
    minute (Kubernetes only: in local mode the agent writes a local file and relays every report); the default
    keeps a training job at about one write a minute, so step and lastCheckpoint in the job's status may be that
    much behind. While the API server answers slowly the agent writes progress less often, up to 6 times this
    interval (a write that took t > 0.1 seconds stretches it by t / 0.1 s); urgent writes never wait."""


AGENT_CPU = "250m"
"""The agent's default CPU request (no CPU limit: it is a small, mostly idle process)."""
AGENT_MEMORY_REQUEST = "512Mi"
"""The agent's default memory request: what it needs when nobody floods its store."""
AGENT_MEMORY = "1Gi"
"""The agent's default memory limit. Its TCPStore server holds whatever a client stores until the guardian
(:mod:`disttrain.trainer.agent.guardian`) deletes it, so a stranger's flood of 8 MiB values costs memory in
proportion to the flood's rate times the sweeper's lag: 406-519 MB peaks were measured under 60 s floods at
42-109 MB/s on 2 shared cores (``bench/store_flood.py``, docs/security.md), over a 230 MB baseline. The limit
leaves twice that headroom."""
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""A Kubernetes resource quantity (``250m``, ``1Gi``, ``2``) as apimachinery's ``resource.Quantity`` parses it,
without the negative ones a pod's resources refuse."""


def _quantity(value: Union[int, str]) -> Union[int, str]:
    """Refuse what the API server would refuse when the agent pod is created, at admission instead."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a resource quantity must not be negative, got {value}")
    elif not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is no resource quantity (e.g. 250m, 1Gi, 2)")
    return value


Quantity = Annotated[
    Union[int, str],
    AfterValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
        }
    ),
]


def _agent_requests() -> dict[str, Union[int, str]]:
    return {"cpu": AGENT_CPU, "memory": AGENT_MEMORY_REQUEST}


def _agent_limits() -> dict[str, Union[int, str]]:
    return {"memory": AGENT_MEMORY}


class AgentResources(ContractModel):
    """Resources of the agent's container. A map given replaces its default as a whole."""

    requests: dict[str, Quantity] = Field(default_factory=_agent_requests, max_length=16)
    """What the scheduler reserves for the agent (cpu, memory, ephemeral-storage)."""
    limits: dict[str, Quantity] = Field(default_factory=_agent_limits, max_length=16)
    """Caps of the agent's container. The memory limit bounds what a flood of its store can take from the node."""


class TolerationOperator(str, enum.Enum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(str, enum.Enum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(ContractModel):
    """A core/v1 Toleration: the agent pod may be placed on nodes with a matching taint."""

    key: Optional[str] = Field(None, max_length=317)
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Optional[TolerationOperator] = None
    """Exists or Equal (Kubernetes' default: Equal)."""
    value: Optional[str] = Field(None, max_length=63)
    """Taint value for operator Equal."""
    effect: Optional[TaintEffect] = None
    """NoSchedule, PreferNoSchedule or NoExecute; unset: every effect."""
    toleration_seconds: Optional[int] = None
    """How long a NoExecute taint is tolerated before eviction; unset: for ever."""


class AgentPlacementSpec(ContractModel):
    """Where the job agent runs and what it reserves. The agent is a small CPU process (TCPStore, status relay):
    it never takes the template's nodeSelector, tolerations or affinity, so a GPU template does not put it on a
    GPU node. It does take the template's imagePullSecrets: its image is the operator's, which a cluster with a
    private registry mirror usually serves with the same pull secret as the workers' image."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    """nodeSelector of the agent pod (e.g. a CPU node pool's label)."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Tolerations of the agent pod."""
    affinity: Optional[dict[str, Any]] = Field(None, json_schema_extra={"x-disttrain-pod-spec-field": "affinity"})
    """A core/v1 Affinity of the agent pod (e.g. a node affinity that keeps it off GPU nodes, or a pod affinity
    near the workers). A podAntiAffinity given here replaces the default of ``avoidWorkers``."""
    avoid_workers: bool = True
    """Prefer nodes that run none of the job's workers (a preferred pod anti-affinity on the node's hostname): a
    node that fails then takes either the agent or workers, and the survivors re-form with a store that is there.
    Preferred, not required: where every node runs a worker the agent still schedules."""
    resources: AgentResources = Field(default_factory=AgentResources)
    """Requests and limits of the agent container; default requests cpu 250m, memory 512Mi, limit memory 1Gi."""
    priority_class_name: Optional[str] = Field(None, min_length=1, max_length=253)
    """PriorityClass of the agent pod. Losing the agent makes every worker re-join a new store, so a class at
    least as high as the workers' (runPolicy.priorityClassName) keeps it from being preempted first. Unset: the
    cluster's default."""


class DistributedDebugLevel(str, enum.Enum):
    """How much torch.distributed checks and says (``TORCH_DISTRIBUTED_DEBUG``)."""

    OFF = "OFF"
    INFO = "INFO"
    DETAIL = "DETAIL"


class NcclDebugSubsystem(str, enum.Enum):
    """A subsystem of NCCL's debug output (``NCCL_DEBUG_SUBSYS``), as NCCL names it."""

    INIT = "INIT"
    COLL = "COLL"
    P2P = "P2P"
    SHM = "SHM"
    NET = "NET"
    GRAPH = "GRAPH"
    TUNING = "TUNING"
    ENV = "ENV"
    ALLOC = "ALLOC"
    CALL = "CALL"
    PROXY = "PROXY"
    NVLS = "NVLS"
    BOOTSTRAP = "BOOTSTRAP"
    REG = "REG"
    PROFILE = "PROFILE"
    RAS = "RAS"
    ALL = "ALL"


class DebugSpec(ContractModel):
    """Diagnosis of distributed bugs, at a cost in speed and log volume: off by default (docs/trainer.md, "Debug
    mode"). A variable the trainer container's env sets itself is kept."""

    distributed: DistributedDebugLevel = DistributedDebugLevel.OFF
    """OFF, INFO or DETAIL: TORCH_DISTRIBUTED_DEBUG for the workers, with c10d's C++ log at INFO and NCCL's debug
    output on. DETAIL checks before every collective that all ranks call the same one (op, shapes, dtypes): ranks
    that call collectives in a different order fail the job at once, as CollectiveDesync naming the ranks and the
    operations, instead of hanging until elastic.collectiveTimeoutSeconds. It costs an extra gloo exchange per
    collective."""
    nccl_subsystems: list[NcclDebugSubsystem] = Field(default_factory=list, max_length=17)
    """NCCL_DEBUG_SUBSYS: the NCCL subsystems that log (INIT, COLL, NET, ...); empty: NCCL's default (INIT, BOOTSTRAP,
    ENV). Naming any turns NCCL's debug output on even with distributed OFF. It goes to one file per process,
    nccl.<host>.<pid>.log, in the launcher's debug folder (<checkpoint dir>/debug/<node>/<start time>-<unique>/, a
    new one for every start of a worker pod)."""
    per_rank_logs: bool = False
    """Copy each worker's stdout and stderr to its own files in the launcher's debug folder
    (logs/<run id>_<unique>/attempt_<restart>/<local rank>/{stdout,stderr}.log): new files for every start of a
    pod and every restart of its workers, so nothing is overwritten; the pod's log keeps the output too. Workers
    start cold (no prestarted interpreter) when this is on."""

    @property
    def is_on(self) -> bool:
        """Whether any debug setting is on."""
        return self.distributed is not DistributedDebugLevel.OFF or bool(self.nccl_subsystems) or self.per_rank_logs


class DistTrainJobSpec(ContractModel):
    template: dict[str, Any] = Field(json_schema_extra={"x-disttrain-pod-template": True})
    """Pod template of a worker node (PodTemplateSpec): image, resources such as nvidia.com/gpu, volumes,
    tolerations, nodeSelector. The container named `trainer` (or the only container) runs the training command
    under torchrun."""
    nodes: NodesSpec
    """Elastic node range; one node is one pod."""
    nproc_per_node: int = Field(1, ge=1, le=1_024)
    """Training processes per node (usually GPUs per pod); world size = nodes x nprocPerNode."""
    rendezvous: RendezvousSpec = Field(default_factory=RendezvousSpec)
    """c10d rendezvous hosted by the job agent."""
    training: TrainingSpec
    """The training contract: batch, LR and length. Immutable while the job runs (suspend it first)."""
    checkpoint: CheckpointSpec
    """Where and how often checkpoints are committed."""
    elastic: ElasticSpec = Field(default_factory=ElasticSpec)
    """Timing of scale, replacement, drain and stuck-pod handling."""
    restart_policy: RestartPolicySpec = Field(default_factory=RestartPolicySpec)
    """Restart budget, backoff and exit-code classes."""
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec)
    """Suspend, deadlines, TTL, pod cleanup and scheduling."""
    success_policy: SuccessPolicy = SuccessPolicy.ALL_WORKERS
    """When the job has succeeded: every worker finished (AllWorkers) or the node running rank 0 finished (RankZero)."""
    reporting: ReportingSpec = Field(default_factory=ReportingSpec)
    """How often the job agent writes training progress into the job's status."""
    agent: AgentPlacementSpec = Field(default_factory=AgentPlacementSpec)
    """Placement and resources of the job agent's pod (nodeSelector, tolerations, affinity, resources,
    priorityClassName), apart from the workers': the template's placement never applies to it."""
    gang: Optional[GangSpec] = None
    """Gang scheduling through a Volcano or scheduler-plugins PodGroup. Unset: pods are scheduled one by one
    (for Kueue, label the job with kueue.x-k8s.io/queue-name instead; see docs/operator.md)."""
    debug: DebugSpec = Field(default_factory=DebugSpec)
    """Debug mode of the workers: torch.distributed's collective checks, NCCL's debug output, per-rank log files."""

    def trainer_container(self) -> dict[str, Any]:
        """The container that runs the trainer: the one named `trainer`, else the only one."""
        pod_containers: list[dict[str, Any]] = self.template.get("spec", {}).get("containers", [])
        return pod_containers[containers.trainer_index(pod_containers)]


class ObjectMeta(BaseModel):
    """The part of metadata disttrain reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(min_length=1, max_length=constants.MAX_JOB_NAME_LENGTH, pattern=constants.DNS_1035_LABEL)
    """DNS-1035 label: it prefixes the names of the job's Services and pods."""
    namespace: str = "default"
    uid: Optional[str] = None
    generation: Optional[int] = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class DistTrainJob(BaseModel):
    """A whole DistTrainJob object as read from a manifest or the API."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", alias_generator=to_camel)
    api_version: str = Field(constants.API_VERSION, pattern=rf"^{constants.GROUP}/{constants.VERSION}$")
    kind: str = Field(constants.KIND, pattern=rf"^{constants.KIND}$")
    metadata: ObjectMeta
    spec: DistTrainJobSpec
    status: Optional[dict[str, Any]] = None
