"""The control channel: keys in the job agent's TCPStore that carry directives to, and progress from, workers.

The job agent hosts the c10d rendezvous store; the same store carries these keys under ``disttrain/`` (torch's
rendezvous uses its own ``torch.rendezvous.*`` prefix). Values are JSON documents of the models below.
The operator never touches the store: it writes ``status.control`` and the agent copies it here.

Everything read from the store is untrusted input: each model bounds its numbers, string lengths and list sizes,
times must be finite Unix times a timestamp can be made of, and :func:`read_model` skips (and logs) any value
over :data:`MAX_VALUE_BYTES` or that does not validate. Who may write these keys at all is the business of
:mod:`disttrain.api.storeauth`: every value is sealed with the job's secret, and the trainer's signed store hands
readers only values that verified (a forged one is absent); this validation is the second layer.
"""

from __future__ import annotations

import enum
import logging
from typing import Optional, Protocol, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from disttrain.api import timestamps
from disttrain.api.reformphases import WorkerStartup

log = logging.getLogger("disttrain.control")

PREFIX = "disttrain/"
# ControlSignal JSON, written by the agent whenever the operator's directive generation changes.
SIGNAL_KEY = PREFIX + "signal"
# TargetPlan JSON: the node count the operator wants the next rendezvous round to complete with.
TARGET_KEY = PREFIX + "target"
# ProgressReport JSON, written by the worker with global rank 0 after each logged step.
PROGRESS_KEY = PREFIX + "progress"
# CheckpointManifest JSON of the newest commit, written by global rank 0 after each commit.
CHECKPOINT_KEY = PREFIX + "checkpoint"
# Unix time (text) the first and the last worker of a group exited on a reform or drain; the next group's rank 0
# reads them into its WorkerStartup and deletes them.
EXIT_FIRST_KEY = PREFIX + "exit-first"
EXIT_LAST_KEY = PREFIX + "exit-last"
# WorkerFailure JSON, written by a worker just before it exits with a permanent (or other notable) code.
# torchrun turns every worker failure into its own exit code 1 (or restarts the worker), so the pod's exit
# code cannot carry the trainer's; this key can.
FAILURE_KEY = PREFIX + "failure"
# ReliabilityReport JSON, written by the agent from the job's status: what the trainer's automatic checkpoint
# interval (spec.checkpoint.intervalSteps: auto) needs to know about failures, which only the operator sees.
RELIABILITY_KEY = PREFIX + "reliability"
# IntervalReport JSON, written by global rank 0 when its automatic checkpoint interval changes.
INTERVAL_KEY = PREFIX + "interval"
# StepBeacon JSON under BEACON_PREFIX + <global rank>: each rank writes its own once per step, just before the
# step's gradient reduction; the job agent's stall rule (disttrain.trainer.agent.stalls) reads them.
BEACON_PREFIX = PREFIX + "beacon/"
# DiagnosticsRequest JSON, written by the agent when it finds a stalled step: every rank's watchdog writes its
# stacks (and NCCL's flight-recorder trace) once per request id.
DIAGNOSTICS_KEY = PREFIX + "diagnostics"
DIAGNOSTICS_FOLDER = "diagnostics"
"""Where the ranks write those, under the job's checkpoint directory: dumps outlive the pod, on the job's volume."""

MAX_VALUE_BYTES = 64 * 1024
"""Largest value :func:`read_model` parses; the biggest legitimate one (a ProgressReport) is under 2 KiB. The
store's own cap is the libuv server's 8 MiB per value, so one read never holds more than that in memory."""
MAX_GENERATION = 2**31 - 1
"""Directive generations count directives (one per drain or reform); anything above this is forged or broken."""
NO_ROUND = -1
"""A directive's or a worker's rendezvous round when it is not known: the generation alone decides."""
MAX_TIME = 253402300799.0
"""9999-12-31T23:59:59Z: the last Unix time an RFC 3339 timestamp can be made of."""
MAX_COUNT = 2**53
"""Steps, samples: integers a JSON reader (the API server, kubectl) still holds exactly."""
MAX_NODES = 100_000
MAX_TEXT = 4096
"""Longest message or reason kept from the store (the status is not a log)."""
MAX_NAME = 253
"""Longest node name, run id or process id (a DNS subdomain)."""


class DirectiveAction(str, enum.Enum):
    """What the operator asks of the workers (``status.control.action``, relayed as :class:`ControlSignal`)."""

    NONE = "none"
    """Keep training."""
    DRAIN = "drain"
    """Checkpoint at the next step boundary, then exit (``ExitCode.DRAINED``): a planned reform loses no step."""
    REFORM = "reform"
    """Exit at once (``ExitCode.REFORM``), even inside a stuck collective; resume from the last checkpoint."""


class ControlSignal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generation: int = Field(ge=0, le=MAX_GENERATION)
    action: DirectiveAction
    reason: str = Field("", max_length=MAX_TEXT)
    job_uid: str = Field("", max_length=MAX_NAME)
    """metadata.uid of the job that issued it: a worker of another job (one recreated under the same name, or
    resumed from an old job's checkpoint) ignores it, and generations are compared only within one uid."""
    round: int = Field(NO_ROUND, ge=NO_ROUND, le=MAX_GENERATION)
    """The rendezvous round it was issued for: the last complete round the agent had seen when it first published
    this generation (:data:`NO_ROUND`: none seen). A worker of a later round ignores it (:func:`judge_directive`)."""


class TargetPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generation: int = Field(ge=0, le=MAX_GENERATION)
    nodes: int = Field(ge=0, le=MAX_NODES)
    exclude: list[str] = Field(default=[], max_length=MAX_NODES)
    """DISTTRAIN_NODE_NAMEs that must not join the next round (scale-down victims waiting to be deleted)."""
    lost: list[str] = Field(default=[], max_length=MAX_NODES)
    """DISTTRAIN_NODE_NAMEs the operator declared lost: dropped from the finished round by the survivors."""
    job_uid: str = Field("", max_length=MAX_NAME)
    """As :attr:`ControlSignal.job_uid`."""
    round: int = Field(NO_ROUND, ge=NO_ROUND, le=MAX_GENERATION)
    """As :attr:`ControlSignal.round`."""


class WorkerFailure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exit_code: int = Field(ge=-255, le=255)
    node: str = Field("", max_length=MAX_NAME)
    message: str = Field("", max_length=MAX_TEXT)
    time: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Unix time of the report."""


class ProgressReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, le=MAX_COUNT)
    samples_consumed: int = Field(ge=0, le=MAX_COUNT)
    world_size: int = Field(ge=1, le=MAX_NODES * 1024)
    plan: dict[str, float | int] = Field(max_length=32)
    loss: Optional[float] = None
    """The step's global, token-weighted loss (docs/trainer.md, "The loss contract"); the agent relays it into
    status.loss when finite."""
    samples_per_second: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    restart_count: int = Field(0, ge=0, le=MAX_COUNT)
    run_id: str = Field("", max_length=MAX_NAME)
    resumed_from_step: Optional[int] = Field(None, ge=0, le=MAX_COUNT)
    resumed_from_job_uid: Optional[str] = Field(None, max_length=MAX_NAME)
    """metadata.uid of the job that wrote the checkpoint this group resumed from (None: unknown or no resume)."""
    resumed_from_memory: Optional[bool] = None
    """This group took its state from its members' memory (True) or from the checkpoint (False) in an in-place
    reform; None: a group that did not reform in place."""
    recovery_note: Optional[str] = Field(None, max_length=512)
    """Why this group loaded its checkpoint although it reforms in place (a rank and its partner lost together, a
    checkpoint newer than memory); None otherwise."""
    process_id: str = Field("", max_length=MAX_NAME)
    """Unique id of the reporting worker process. torchrun starts new worker processes after every completed
    rendezvous round, so a new id means a new group even when run id, restart count and world size repeat."""
    time: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Unix time of the report."""
    startup: Optional[WorkerStartup] = None
    """When this process started, phase by phase (the agent relays it into ``status.workerStartup``)."""
    checkpoint_blocked_seconds: Optional[float] = Field(None, ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Seconds this process's training waited for checkpoint saves since it started (sync saves, an async save's
    kick-off and staging); the agent relays it into ``status.checkpointBlockedSeconds``."""
    in_place_fallback: Optional[str] = Field(None, max_length=512)
    """Why reforms restart this group's workers from the last checkpoint although ``spec.elastic.reformInPlace``
    asks to keep them (a model passed already wrapped, no launcher channel); None: in place applies, or was
    not asked for. The agent relays it into ``status.inPlaceFallback``."""
    checkpoint_upload: Optional[str] = Field(None, max_length=512)
    """With ``checkpoint.uri``: how far the bucket is behind the local tier (saves not yet COMPLETE there, the last
    error); None while it keeps up. The agent relays it into ``status.checkpointUpload``."""

    @field_validator("plan")
    @classmethod
    def _finite_plan(cls, plan: dict[str, float | int]) -> dict[str, float | int]:
        for key, value in plan.items():
            if len(key) > 64 or not abs(value) <= MAX_COUNT:  # also refuses NaN
                raise ValueError(f"plan[{key[:64]!r}]={value!r} is not a plan entry")
        return plan


class ReliabilityReport(BaseModel):
    """The job's failure history as the operator counted it (status.startTime, restarts, suspensions)."""

    model_config = ConfigDict(extra="forbid")
    started_at: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Unix time of status.startTime (the job first ran)."""
    suspended_seconds: float = Field(0.0, ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Seconds spent suspended since then (no failure can happen while suspended)."""
    failures: int = Field(0, ge=0, le=MAX_COUNT)
    """status.restarts.total plus the infrastructure losses that redo steps (node losses, evictions; not a
    departure or the agent's loss): failures so far."""

    def age_seconds(self, now: float) -> float:
        """Running time of the job at Unix time ``now``."""
        return max(0.0, now - self.started_at - self.suspended_seconds)


class IntervalReport(BaseModel):
    """The automatic checkpoint interval rank 0 chose, and what it chose it from (relayed to
    status.checkpointInterval)."""

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(ge=1, le=MAX_COUNT)
    save_seconds: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    step_seconds: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    mtbf_seconds: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    failures: int = Field(0, ge=0, le=MAX_COUNT)
    time: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Unix time of the choice."""


def beacon_key(rank: int) -> str:
    """Store key of global rank ``rank``'s :class:`StepBeacon`."""
    return f"{BEACON_PREFIX}{rank}"


class StepBeacon(BaseModel):
    """One rank reached a step's gradient reduction (written just before the step's last backward)."""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=1, le=MAX_COUNT)
    """The step being computed (the step counter once it completes)."""
    rank: int = Field(ge=0, le=MAX_NODES * 1024)
    world_size: int = Field(ge=1, le=MAX_NODES * 1024)
    group: str = Field("", max_length=MAX_NAME)
    """The group the rank belongs to (its store endpoint, new with every round): beacons of an older group are
    not compared with the current one's."""
    node: str = Field("", max_length=MAX_NAME)
    """DISTTRAIN_NODE_NAME (the pod name)."""
    pod_uid: str = Field("", max_length=64)
    saving: bool = False
    """An asynchronous save of this rank was still in flight: the stall rule waits twice as long."""
    time: float = Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)
    """Unix time on the rank's own clock: only differences between one rank's beacons are used."""


class DiagnosticsRequest(BaseModel):
    """Every rank: write your stacks (and NCCL's flight-recorder trace) once per ``id``, under
    ``$DISTTRAIN_CHECKPOINT_DIR/diagnostics/<node>/`` (the folder is the worker's own: no path comes from the store)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=MAX_NAME)
    """What the dump files are named after (``stall-<step>``)."""
    job_uid: str = Field("", max_length=MAX_NAME)


class DirectiveVerdict(str, enum.Enum):
    """What a worker does with the directive it reads (:func:`judge_directive`)."""

    ACT = "act"
    """A new directive for this worker's round (or a later one): act on it."""
    SEEN = "seen"
    """The generation this worker already acted on or took as history."""
    OLDER = "older"
    """A generation below this worker's history: a replay. Logged and counted, never acted on."""
    EARLIER_ROUND = "earlier-round"
    """Issued for a round before this worker's: the directive that formed this round, or a replay. Logged and
    counted, never acted on."""
    FOREIGN = "foreign"
    """Issued by another job (one recreated under the same name)."""


def judge_directive(signal: ControlSignal, *, job_uid: str, history: int, worker_round: int) -> DirectiveVerdict:
    """Whether a worker of rendezvous round ``worker_round`` whose history (the newest generation it acted on or
    took as history) is ``history`` acts on ``signal``.

    A directive is bound to the round it was issued for: a worker of a later round never acts on it, whatever its
    history says, so a replayed old directive (a genuine envelope, validly signed) cannot make a fresh worker
    reform again. A round or a job uid that is not known on either side leaves the decision to the generation."""
    if signal.job_uid and job_uid and signal.job_uid != job_uid:
        return DirectiveVerdict.FOREIGN
    if signal.generation < history:
        return DirectiveVerdict.OLDER
    if signal.generation == history:
        return DirectiveVerdict.SEEN
    if signal.round != NO_ROUND and worker_round != NO_ROUND and signal.round < worker_round:
        return DirectiveVerdict.EARLIER_ROUND
    return DirectiveVerdict.ACT


def last_complete_round(round_: int, complete: bool) -> int:
    """The last complete round of a rendezvous state at ``round_`` (torch opens round n + 1 when every participant
    of a complete round n left it): the round a directive published now is issued for."""
    return round_ if complete else max(NO_ROUND, round_ - 1)


def parse_round(value: Optional[str]) -> int:
    """A worker's round from ``$DISTTRAIN_RENDEZVOUS_ROUND``; :data:`NO_ROUND` when unset or not a round."""
    text = (value or "").strip()
    if not text.isdigit() or len(text) > 10:
        return NO_ROUND
    return min(int(text), MAX_GENERATION)


def is_valid_time(value: str) -> bool:
    """Whether ``value`` is an RFC 3339 time the operator and the agent can parse and format again."""
    try:
        parsed = timestamps.parse_time(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return parsed is not None and 0.0 <= parsed <= MAX_TIME


def is_drain_checkpoint(issued_at: Optional[float], committed_at: Optional[float]) -> bool:
    """A checkpoint committed at or after the drain directive was issued (both Unix times; None: unknown), the one
    a drain waits for: the operator deletes the drain's victims once the status names it, and the job agent writes
    it to the status at once (later ones wait for its periodic write). One rule, so the two never disagree."""
    return issued_at is not None and committed_at is not None and committed_at >= issued_at


class StoreReader(Protocol):
    """The part of a ``torch.distributed.Store`` that :func:`read_model` uses (the api never imports torch)."""

    def check(self, keys: list[str], /) -> bool: ...

    def get(self, key: str, /) -> Union[bytes, str]: ...


Model = TypeVar("Model", bound=BaseModel)


def read_model(store: StoreReader, key: str, model: type[Model]) -> Optional[Model]:
    """The ``model`` stored under ``key``; None when the key is absent or empty, or its value does not parse.

    ``check`` comes first because ``get`` blocks until the key exists. A value that is too large or does not
    validate is logged and skipped, never raised: a half-upgraded peer, a torn write or a hostile one must not
    stop the reader (the agent, the rendezvous handler, the watchdog), which simply tries again on its next round.
    """
    if not store.check([key]):
        return None
    return parse_model(store.get(key), key, model)


class BatchReader(StoreReader, Protocol):
    def multi_get(self, keys: list[str], /) -> list[bytes]: ...


def read_models(store: BatchReader, keys: list[str], model: type[Model]) -> Optional[list[Optional[Model]]]:
    """The ``model`` under each of ``keys`` (None for a value that does not parse, as :func:`read_model`), read
    in one ``check`` and one ``multi_get``; None when not every key holds a valid value (the caller reads those
    one by one). The job agent reads a beacon per rank this way: thousands of ranks, two round trips."""
    if not keys or not store.check(keys):
        return None
    return [parse_model(raw, key, model) for key, raw in zip(keys, store.multi_get(keys), strict=True)]


def parse_model(raw: Union[bytes, str], key: str, model: type[Model]) -> Optional[Model]:
    """``raw`` (the value under ``key``) as ``model``; None, logged, when empty, too large or invalid."""
    if not raw:
        return None
    if len(raw) > MAX_VALUE_BYTES:
        log.warning("ignoring a %d-byte %s under %s (limit %d)", len(raw), model.__name__, key, MAX_VALUE_BYTES)
        return None
    try:
        return model.model_validate_json(raw)
    except ValueError as error:
        log.warning("ignoring an invalid %s under %s: %s: %r", model.__name__, key, _first_error(error), raw[:200])
        return None


def _first_error(error: ValueError) -> str:
    return str(error).splitlines()[1] if len(str(error).splitlines()) > 1 else str(error)
