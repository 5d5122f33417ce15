"""The job agent: ``python -m disttrain.trainer.agent``. One small pod per job (or one process in local mode).

Why it exists: the c10d rendezvous store must outlive every worker (if it lives in a worker, losing that worker
kills the job, pytorch/elastic#115), and the operator needs a channel to the workers that does not depend on any
of them. The agent

* hosts the TCPStore that torchrun's rendezvous (``is_host=false``) and the trainer's control channel use, and
  uses it, as they do, only inside the job's secret key namespace (:mod:`disttrain.api.storeauth`);
* follows its job's ``status.control`` (the operator's directive) and writes it into ``SIGNAL_KEY`` and
  ``TARGET_KEY``, and what the operator counted of failures into ``RELIABILITY_KEY`` (for the trainer's
  ``intervalSteps: auto``);
* relays the trainer's ``PROGRESS_KEY``, ``CHECKPOINT_KEY``, ``FAILURE_KEY`` and ``INTERVAL_KEY`` into the job's
  status fields it owns (:data:`disttrain.api.status.AGENT_FIELDS`; it writes no other), and the ranks' step
  beacons into ``stalledNodes`` (:mod:`disttrain.trainer.agent.stalls`);
* guards the store it hosts (:mod:`disttrain.trainer.agent.guardian`): deletes what a client without the job's secret
  put in, restores sealed values deleted, garbled or replayed, re-writes its own keys when they vanish, and
  reports what it rejected in ``status.storeRejections``.

Where the job lives is a :class:`JobSource`: :class:`KubeJobSource` follows the DistTrainJob through a watch
and patches only its status subresource (the agent's Role allows nothing else); :class:`FileJobSource` lets the
local runtime drive the same agent from a state directory. On Kubernetes the agent writes progress at a bounded
rate (:mod:`disttrain.trainer.agent.reporting`): what the operator acts on at once, the rest at most every
``spec.reporting.progressIntervalSeconds``. If the agent dies, the operator recreates it; the workers re-join
the new store and resume from the last complete checkpoint, so nothing is lost.

The spec is read through :mod:`disttrain.api.agentview` (the spec's own models and defaults), once per change. A
job the agent cannot read is logged once, by field; the agent goes on hosting the store and passing on the
directive, and writes no status until the job can be read.

It never imports kopf or the operator package.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import json
import logging
import math
import os
import pathlib
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol, cast

from disttrain.api import agentview, constants, env, storeauth
from disttrain.api import control as keys
from disttrain.api import pulse as pulse_wire
from disttrain.api.contract import job_checkpoint_dir
from disttrain.api.manifest import CheckpointManifest
from disttrain.api.status import AGENT_FIELDS
from disttrain.api.timestamps import format_time
from disttrain.common import versions
from disttrain.trainer.agent import guardian, heartbeats, lease, pulse, reporting, stalls
from disttrain.trainer.checkpoint import autointerval
from disttrain.trainer.checkpoint.commit import step_dir_name

log = logging.getLogger("disttrain.agent")
REQUEST_TIMEOUT_S = 30.0
"""Client-side timeout of every API request but the watch (a hung connection must not stall the agent)."""
FIELD_MANAGER = "disttrain-agent"
"""The agent's name in the job's ``metadata.managedFields``: the status fields it writes are told apart from the
operator's (``disttrain-operator``); without a name both would be the client's User-Agent."""
WATCH_SECONDS = 300
"""Server-side length of one watch request (drawn from 1-2x this); the agent resumes from the last resourceVersion
after it."""
MAX_RETRY_S = 30.0
"""Longest wait between two rounds after failures (an API server that refuses or times out)."""


class JobSource(Protocol):
    """Where the agent reads its job and writes its part of the status."""

    rate_limited: bool
    """Whether writes cost an API server request (then progress is written at the job's progress interval)."""

    def read(self) -> Optional[dict[str, Any]]:
        """The DistTrainJob (wire form, with status), or None when it no longer exists."""

    def patch_status(self, patch: dict[str, Any]) -> None:
        """Merge-patch (RFC 7386) ``status`` with ``patch``."""

    def wait_for_change(self, timeout: float) -> None:
        """Return when the job changed, or after ``timeout`` seconds."""


class FileJobSource:
    """Local mode: the job is ``<state>/job.json`` (written by the local runtime), and the agent's status fields
    go to ``<state>/agent-status.json`` (written only by the agent, atomically), which the runtime merges into
    the job's status before each reconcile. Two files, one writer each: no lost updates."""

    rate_limited = False  # a local file: relaying every report costs nothing

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = pathlib.Path(state_dir)
        self.job_path = self.state_dir / constants.LOCAL_JOB_FILE
        self.status_path = self.state_dir / constants.LOCAL_AGENT_STATUS_FILE

    def read(self) -> Optional[dict[str, Any]]:
        try:
            job: dict[str, Any] = json.loads(self.job_path.read_text())
        except FileNotFoundError:
            return None
        status = dict(job.get("status") or {})
        status.update(self.agent_status())
        job["status"] = status
        return job

    def agent_status(self) -> dict[str, Any]:
        try:
            document = json.loads(self.status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return document if isinstance(document, dict) else {}

    def patch_status(self, patch: dict[str, Any]) -> None:
        current = self.agent_status()
        for key, value in patch.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=".agent-status.")
        with os.fdopen(fd, "w") as handle:
            json.dump(current, handle)
        os.replace(tmp, self.status_path)

    def wait_for_change(self, timeout: float) -> None:
        time.sleep(timeout)  # the runtime rewrites job.json; the next read sees it


class KubeJobSource:
    """Kubernetes: a watch on the job (GET once, then ``watch`` from its resourceVersion, resumed after every
    timeout; a 410 Gone starts over with a GET), PATCH of its status subresource (merge patch).

    The agent's Role allows exactly this: get and watch on its job, get and patch on its status. A GET gives the
    resourceVersion to watch from, so no ``list`` is needed; a watch with the field selector ``metadata.name``
    is authorized against the job's name. The newest object seen (from the watch or a patch response) is what
    :meth:`read` returns, so the agent never reads its own write back from the server.
    """

    rate_limited = True

    def __init__(
        self, namespace: str, name: str, api_client: Any = None, *, watch_seconds: int = WATCH_SECONDS
    ) -> None:
        kube = _kubernetes()
        if api_client is None:
            try:
                kube.config.load_incluster_config()
            except kube.config.ConfigException:
                kube.config.load_kube_config()
            api_client = kube.client.ApiClient()
        self.api = kube.client.CustomObjectsApi(api_client)
        self.namespace, self.name = namespace, name
        self.watch_seconds = watch_seconds
        self._api_error = kube.client.ApiException
        self._job: Optional[dict[str, Any]] = None
        self._gone = False
        self._synced = threading.Event()
        self._changed = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._follower: Optional[threading.Thread] = None

    def read(self) -> Optional[dict[str, Any]]:
        """The newest job seen; waits for the first GET (raising TimeoutError after the request timeout)."""
        if self._follower is None:
            self._follower = threading.Thread(target=self._follow, name=f"watch-{self.name}", daemon=True)
            self._follower.start()
        if not self._synced.wait(REQUEST_TIMEOUT_S):
            raise TimeoutError(f"no answer from the API server about {self.namespace}/{self.name}")
        with self._lock:
            return None if self._gone else self._job

    def patch_status(self, patch: dict[str, Any]) -> None:
        job = self.api.patch_namespaced_custom_object_status(
            constants.GROUP,
            constants.VERSION,
            self.namespace,
            constants.PLURAL,
            self.name,
            {"status": patch},
            field_manager=FIELD_MANAGER,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
        self._remember(cast("dict[str, Any]", job))

    def wait_for_change(self, timeout: float) -> None:
        self._changed.wait(timeout)
        self._changed.clear()

    def close(self) -> None:
        self._stop.set()

    def _remember(self, job: dict[str, Any]) -> None:
        """Keep ``job`` unless a newer version is already kept (a patch response and the watch race)."""
        with self._lock:
            if self._job is None or not versions.is_older(_version(job), _version(self._job)):
                self._job = job
        self._changed.set()

    def _mark_gone(self) -> None:
        with self._lock:
            self._gone = True
        self._synced.set()
        self._changed.set()

    def _follow(self) -> None:
        """GET, then watch from its resourceVersion until the job is deleted; reconnect after any error."""
        kube = _kubernetes()
        version: Optional[str] = None
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if version is None:
                    job = cast(
                        "dict[str, Any]",
                        self.api.get_namespaced_custom_object(
                            constants.GROUP,
                            constants.VERSION,
                            self.namespace,
                            constants.PLURAL,
                            self.name,
                            _request_timeout=REQUEST_TIMEOUT_S,
                        ),
                    )
                    self._remember(job)
                    self._synced.set()
                    version = _version(job)
                # 1-2x the watch length, as client-go's reflectors do: agents started together would otherwise all
                # end and re-open their watches in the same second, every time
                watch_seconds = int(self.watch_seconds * random.uniform(1.0, 2.0))
                stream = kube.watch.Watch().stream(
                    self.api.list_namespaced_custom_object,
                    constants.GROUP,
                    constants.VERSION,
                    self.namespace,
                    constants.PLURAL,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=watch_seconds,
                    _request_timeout=(REQUEST_TIMEOUT_S, watch_seconds + REQUEST_TIMEOUT_S),
                )
                try:
                    for event in stream:
                        obj = event["raw_object"]
                        version = _version(obj) or version
                        if event["type"] == "DELETED":
                            self._mark_gone()
                            return
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._remember(obj)
                        if self._stop.is_set():
                            return
                finally:
                    stream.close()  # the watch's connection goes back now, not whenever the generator is collected
                backoff = 0.5
            except self._api_error as error:
                if self._stop.is_set():
                    return
                if error.status == 404:
                    self._mark_gone()
                    return
                if error.status == 410:  # our resourceVersion is too old to watch from: read the job afresh
                    version = None
                    continue
                log.warning(
                    "watch of %s/%s failed: %s %s; retrying", self.namespace, self.name, error.status, error.reason
                )
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 10.0)
            except Exception as error:  # noqa: BLE001 (connection reset, timeout: resume from the last version)
                if self._stop.is_set():
                    return
                log.warning("watch of %s/%s interrupted: %r; resuming", self.namespace, self.name, error)
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 10.0)


def _kubernetes() -> Any:
    """The kubernetes client package, imported when first needed (local mode needs none). Typed as Any: its
    configuration and watch functions carry no annotations."""
    import kubernetes

    return kubernetes


def _version(obj: dict[str, Any]) -> Optional[str]:
    return (obj.get("metadata") or {}).get("resourceVersion")


class Agent:
    """One job's agent. ``sync()`` does one round of follow + relay; ``run()`` loops until stopped."""

    def __init__(
        self,
        source: JobSource,
        store: Any,
        *,
        poll_seconds: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        guard: Optional[guardian.Guardian] = None,
    ) -> None:
        self.source = source
        self.store = store
        self.guardian = guard
        """The store's sweeper (None: not guarded, as in tests of the relay alone); the agent relays its counts."""
        self.poll_seconds = poll_seconds
        self.clock = clock
        self.stop_event = threading.Event()
        self.throttle = reporting.ProgressThrottle()
        self.status_writes: collections.Counter[str] = collections.Counter()
        """Status writes by reason (:meth:`reporting.ProgressThrottle.write_reason`): where a job's API requests go."""
        self._written_signal: Optional[str] = None
        self._written_target: Optional[str] = None
        self._written_reliability: Optional[str] = None
        self._directive_round: Optional[tuple[int, int]] = None
        """(generation, round) of the directive published last: the round it was issued for."""
        self._round_key: Optional[tuple[Any, ...]] = None
        self._rounds: Optional[int] = None
        self._round_start: Optional[str] = None
        self._view: Optional[agentview.AgentJob] = None
        self._view_input: Optional[dict[str, Any]] = None
        """What :attr:`_view` was parsed from (:func:`disttrain.api.agentview.view_input`); the job is parsed again
        only when it changes."""
        self.heartbeats = heartbeats.HeartbeatWatch(store, None if guard is None else _rendezvous_rejections(guard))
        """Silent nodes; heartbeats are distrusted while the guardian or the store sees the rendezvous tampered with."""
        self.stalls = stalls.StallWatch(store)
        """Stalled steps, from the ranks' step beacons (:mod:`disttrain.trainer.agent.stalls`)."""

    def sync(self) -> bool:
        """Follow the directive and relay progress once. False when the job is gone (the agent should exit)."""
        job = self.source.read()
        if job is None:
            return False
        status = job.get("status") or {}
        view = self._read_view(job)
        self._rewrite_vanished()
        # The directive and the failure counts come from the status, not the spec: they reach the workers even
        # while the spec cannot be read.
        uid = str((job.get("metadata") or {}).get("uid") or "")
        self._write_directive(status.get("control") or {}, uid, None if view is None else view.run_id)
        self._write_reliability(status)
        if view is None:
            return True
        patch = self._relay(view, status)
        reason = self._write_reason(view, status, patch) if patch else None
        if reason is not None:
            self.status_writes[reason] += 1
            started = self.clock()
            try:
                self.source.patch_status(patch)
            finally:  # a failed write counts too: retried at once only if urgent (its changes still are)
                finished = self.clock()
                self.throttle.wrote(finished, took=finished - started)
        return True

    def _read_view(self, job: dict[str, Any]) -> Optional[agentview.AgentJob]:
        """The typed view of ``job`` (:mod:`disttrain.api.agentview`), parsed again only when it changed; None while
        the job cannot be read.

        A job the agent cannot read is logged as an error once per version, naming every field that is wrong. The
        agent goes on hosting the store and passing on the directive, and writes no status until a version it can
        read: exiting would take the rendezvous down with it and come back to the same job, in a loop."""
        wanted = agentview.view_input(job)
        if wanted == self._view_input:
            return self._view
        refused_before = self._view_input is not None and self._view is None
        self._view_input = copy.deepcopy(wanted)
        try:
            self._view = agentview.parse_job(job)
        except agentview.SpecRefused as refused:
            self._view = None
            log.error("%s; no status is written until the job can be read", refused)
            return None
        if refused_before:
            log.info("the job can be read again; writing status")
        return self._view

    def _write_reason(self, job: agentview.AgentJob, status: dict[str, Any], patch: dict[str, Any]) -> Optional[str]:
        """Why ``patch`` is written now; None when it waits for a later periodic write (Kubernetes only; see
        :mod:`disttrain.trainer.agent.reporting`)."""
        if not self.source.rate_limited:
            return reporting.UNTHROTTLED
        urgent = reporting.urgent_reason(patch, status, job.spec.training)
        interval_s = float(job.spec.reporting.progress_interval_seconds)
        now = self.clock()
        reason = self.throttle.write_reason(urgent=urgent, interval_s=interval_s, now=now)
        if reason is not None and urgent is not None:
            log.info("writing status at once: %s", urgent)
        return reason

    def _write_directive(self, control: dict[str, Any], job_uid: str, run_id: Optional[str] = None) -> None:
        try:
            generation = int(control.get("generation", 0))
            round_ = self._round_of(generation, run_id)
            signal_value = keys.ControlSignal(
                generation=generation,
                action=control.get("action", "none"),
                reason=str(control.get("reason", ""))[: keys.MAX_TEXT],
                job_uid=job_uid,
                round=round_,
            ).model_dump_json()
            target_nodes = int(control.get("targetNodes", 0))
            target_value = keys.TargetPlan(
                generation=generation,
                nodes=target_nodes,
                exclude=list(control.get("exclude") or []),
                lost=list(control.get("lost") or []),
                job_uid=job_uid,
                round=round_,
            ).model_dump_json()
        except (TypeError, ValueError) as error:
            log.warning("ignoring an invalid status.control %r: %s", control, error)
            return
        if signal_value != self._written_signal:
            self.store.set(keys.SIGNAL_KEY, signal_value)
            self._written_signal = signal_value
            log.info("directive %s", signal_value)
            if control.get("action", "none") != "none":
                self.heartbeats.directive_published()
        if target_nodes > 0 and target_value != self._written_target:
            self.store.set(keys.TARGET_KEY, target_value)
            self._written_target = target_value

    def _round_of(self, generation: int, run_id: Optional[str]) -> int:
        """The rendezvous round directive ``generation`` is issued for: the last complete round seen when this agent
        first published it, kept for as long as the generation stands (a rewrite after a stranger deleted the key
        keeps it, so the group formed after the directive never takes it for its own)."""
        if self._directive_round is None or self._directive_round[0] != generation:
            seen = self.heartbeats.last_complete_round
            if run_id is not None:
                try:
                    seen = self.heartbeats.read_round(run_id)
                except Exception as error:  # noqa: BLE001 - the round last seen will do; the state is read each sync
                    log.debug("could not read the rendezvous round: %r", error)
            self._directive_round = (generation, seen)
        return self._directive_round[1]

    def _rewrite_vanished(self) -> None:
        """Forget what was written when one of the agent's own keys is gone or no longer valid (a stranger deleted
        or garbled it): this round writes them all again. One ``check`` per round; the store is local."""
        written = [
            key
            for key, value in (
                (keys.SIGNAL_KEY, self._written_signal),
                (keys.TARGET_KEY, self._written_target),
                (keys.RELIABILITY_KEY, self._written_reliability),
            )
            if value is not None
        ]
        if written and not self.store.check(written):
            log.warning("own store keys vanished or were garbled (%s); writing them again", ", ".join(written))
            self._written_signal = self._written_target = self._written_reliability = None

    def _write_reliability(self, status: dict[str, Any]) -> None:
        """Tell the trainer what the operator knows of failures (for ``intervalSteps: auto``), when it changes."""
        value = autointerval.reliability_from_status(status)
        if value is not None and value != self._written_reliability:
            self.store.set(keys.RELIABILITY_KEY, value)
            self._written_reliability = value

    def _relay(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        """Agent-owned status fields that differ from what the job's status holds.

        Each record is relayed on its own: one that cannot be (a value that passed the model but not the status,
        a store error) is logged and skipped, and the others still go out. A bad value must never stop the
        status updates for good, as it did when one exception ended the whole round every time."""
        wanted: dict[str, Any] = {}
        relays = (
            self._relay_progress,
            self._relay_checkpoint,
            self._relay_failure,
            self._relay_interval,
            self._relay_silent,
            self._relay_stalled,
            self._relay_rejections,
        )
        for relay in relays:
            try:
                wanted.update(relay(job, status))
            except Exception as error:  # noqa: BLE001 - skip this record, keep the others flowing
                log.warning("not relaying %s: %r", relay.__name__.removeprefix("_relay_"), error)
        return {k: v for k, v in wanted.items() if k in AGENT_FIELDS and status.get(k) != v}

    def _relay_progress(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        wanted: dict[str, Any] = {}
        report = keys.read_model(self.store, keys.PROGRESS_KEY, keys.ProgressReport)
        if report is not None:
            if self._rounds is None:
                self._rounds = int(status.get("rendezvousRound", 0))
            # A new group (round) is a new rank-0 process; the run id, restart count and world size can all
            # repeat (a replaced node that becomes rank 0 after a reform at the same size), the process id not.
            round_key = (report.run_id, report.restart_count, report.world_size, report.process_id)
            if round_key != self._round_key:
                adopted = self._round_key is None and _same_group(report, status)
                self._round_key = round_key
                if adopted:  # this agent replaces a lost one beside the group that trained on: not a new round
                    self._round_start = status.get("roundStartTime") or format_time(report.time)
                else:
                    self._rounds += 1
                    self._round_start = format_time(report.time)
            wanted.update(
                step=report.step,
                samplesConsumed=report.samples_consumed,
                worldSize=report.world_size,
                plan=report.plan,
                lastProgressTime=format_time(report.time),
                rendezvousRound=self._rounds,
                roundStartTime=self._round_start,
                inPlaceFallback=report.in_place_fallback,  # None removes a previous group's reason
                checkpointUpload=report.checkpoint_upload,  # None once the bucket caught up
                resumedFromStep=report.resumed_from_step,
                resumedFromJobUid=report.resumed_from_job_uid,
                resumedFromMemory=report.resumed_from_memory,
                recoveryNote=report.recovery_note,
            )
            if report.samples_per_second is not None:
                wanted["samplesPerSecond"] = round(report.samples_per_second, 1)
            if report.checkpoint_blocked_seconds is not None:
                wanted["checkpointBlockedSeconds"] = report.checkpoint_blocked_seconds
            if report.loss is not None and math.isfinite(report.loss):
                wanted["loss"] = float(f"{report.loss:.6g}")
            startup = report.startup
            if startup is not None and status.get("workerStartup") != startup.model_dump(
                by_alias=True, exclude_none=True
            ):
                wanted["workerStartup"] = startup.model_dump(by_alias=True)  # nulls remove an older group's stamps
        return wanted

    def _relay_checkpoint(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        wanted: dict[str, Any] = {}
        manifest = keys.read_model(self.store, keys.CHECKPOINT_KEY, CheckpointManifest)
        if manifest is not None and not keys.is_valid_time(manifest.created_at):
            raise ValueError(f"checkpoint step {manifest.step} has createdAt={manifest.created_at[:64]!r}, no time")
        if manifest is not None:
            path = _checkpoint_location(job, manifest)
            wanted["lastCheckpoint"] = {
                "step": manifest.step,
                "samples": manifest.samples_consumed,
                "path": path,
                "time": manifest.created_at,
                "worldSize": manifest.world_size,
            }
        return wanted

    def _relay_failure(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        wanted: dict[str, Any] = {}
        failure = keys.read_model(self.store, keys.FAILURE_KEY, keys.WorkerFailure)
        if failure is not None:
            wanted["workerFailure"] = {
                "exitCode": failure.exit_code,
                "node": failure.node,
                "message": failure.message,
                "time": format_time(failure.time),
            }
        return wanted

    def _relay_interval(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        report = keys.read_model(self.store, keys.INTERVAL_KEY, keys.IntervalReport)
        return {} if report is None else {"checkpointInterval": autointerval.interval_status(report)}

    def _relay_silent(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        """Nodes silent in the rendezvous heartbeats (:mod:`disttrain.trainer.agent.heartbeats`); None clears the field.
        With them the pods of the completed round, read from the same state."""
        self.heartbeats.beside_running_group = int(status.get("worldSize") or 0) > 0
        report = self.heartbeats.report(job, self.clock())
        if report and report != status.get("silentNodes"):
            log.warning("silent in the rendezvous heartbeats: %s", report)
        return {"silentNodes": report or None, "roundMembers": self.heartbeats.members}

    def _relay_stalled(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        """Nodes behind a stalled step (:mod:`disttrain.trainer.agent.stalls`); None clears the field. A stall just
        found first asks every rank for its stacks (``DIAGNOSTICS_KEY``); it is reported a moment later."""
        elastic = job.spec.elastic
        action = (status.get("control") or {}).get("action") or keys.DirectiveAction.NONE.value
        directory = f"{_checkpoint_dir(job)}/{keys.DIAGNOSTICS_FOLDER}"
        report, found = self.stalls.report(
            factor=float(elastic.stall_factor),
            min_seconds=float(elastic.stall_min_seconds),
            quiet=action != keys.DirectiveAction.NONE.value,
            directory=directory,
            now=self.clock(),
        )
        if found is not None:
            log.warning(
                "stalled at step %d for %.1f s: rank(s) %s behind; asking every rank for its stacks",
                found.step,
                found.waited_s,
                ", ".join(f"{lag.rank} ({lag.node})" for lag in found.laggards),
            )
            request = keys.DiagnosticsRequest(id=stalls.request_id(found), job_uid=job.metadata.uid or "")
            self.store.set(keys.DIAGNOSTICS_KEY, request.model_dump_json())
        return {"stalledNodes": report or None}

    def _relay_rejections(self, job: agentview.AgentJob, status: dict[str, Any]) -> dict[str, Any]:
        """What the store guardian rejected (``storeRejections``; the operator counts it and posts Events)."""
        snapshot = None if self.guardian is None else self.guardian.snapshot()
        return {} if snapshot is None else {"storeRejections": snapshot}

    def run(self) -> int:
        """Loop until the job is gone or ``stop_event`` is set; transient API errors are logged and retried.

        A round runs every ``poll_seconds`` (the store is local: reading it is free) and at once when the job
        changes, so a new directive reaches the workers without waiting for the next round.
        """
        failures = 0
        while not self.stop_event.is_set():
            try:
                if not self.sync():
                    log.info("job is gone; exiting")
                    return 0
                failures = 0
                self.source.wait_for_change(self.poll_seconds)
            except Exception as error:
                failures += 1
                delay = max(retry_delay(self.poll_seconds, failures), retry_after(error))
                if is_throttled(error):  # API Priority and Fairness: the request waited its turn too long
                    log.warning("API server: 429, slow down (%d in a row); retrying in %.1f s", failures, delay)
                elif failures == 1:
                    log.exception("agent round failed; retrying")
                else:
                    log.warning("agent round failed again (%d in a row): %r", failures, error)
                self.stop_event.wait(delay)
        return 0


def is_throttled(error: BaseException) -> bool:
    """A 429: the API server's priority and fairness refused the request (its queue was full, or it waited too
    long in it). Routine under load, and no fault of the agent: one line, no traceback."""
    return getattr(error, "status", None) == 429


def retry_after(error: BaseException, cap_s: float = MAX_RETRY_S) -> float:
    """Seconds the API server asked to wait (``Retry-After``) before the next try; 0 when it said nothing."""
    headers = getattr(error, "headers", None) or {}
    try:
        return min(cap_s, max(0.0, float(headers.get("Retry-After", 0))))
    except (TypeError, ValueError):
        return 0.0


def retry_delay(poll_seconds: float, failures: int, cap_s: float = MAX_RETRY_S) -> float:
    """Seconds before the next round after ``failures`` failed ones in a row: doubling from the poll period up to
    ``cap_s``, jittered, so that the agents of many jobs do not hammer a struggling API server in step."""
    return min(cap_s, poll_seconds * 2.0 ** min(failures - 1, 16)) * random.uniform(0.5, 1.0)


def _checkpoint_location(job: agentview.AgentJob, manifest: CheckpointManifest) -> str:
    """Where a committed checkpoint is: its prefix in the bucket of ``checkpoint.uri`` (where the trainer reports
    only what the bucket completed), else its directory on the volume as the worker pods see it."""
    uri = job.spec.checkpoint.uri
    if uri:
        return f"{uri.rstrip('/')}/{step_dir_name(manifest.step)}/r{manifest.fence_round or 0}"
    return f"{_checkpoint_dir(job)}/{step_dir_name(manifest.step)}"


def _checkpoint_dir(job: agentview.AgentJob) -> str:
    """The job's checkpoint directory as the worker pods see it (``$DISTTRAIN_CHECKPOINT_DIR``)."""
    return job_checkpoint_dir(job.spec.checkpoint.path, job.metadata.namespace, job.metadata.name)


def start_store(port: int = 0, host: str = "127.0.0.1", timeout_s: float = 60.0) -> Any:
    """The TCPStore server the c10d rendezvous and the control channel share; the agent's is on the loopback's
    free port only, and clients reach it through the front (:func:`start_front`). torch imported here only.

    The libuv server, chosen explicitly: it refuses a value over 8 MiB (the other one takes any size), which bounds
    what one client can make the agent hold per key. It is handed a socket listening on ``host:port``: given a
    port alone, it would bind every address."""
    from torch.distributed import TCPStore

    from disttrain.trainer.store import front

    listener = front.listener(host, port)
    return TCPStore(
        host,
        int(listener.getsockname()[1]),
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        use_libuv=True,
        master_listen_fd=listener.detach(),
    )


def start_front(host: str, port: int, server: Any) -> Any:
    """The store's front on ``host:port`` (the store port the job's clients know), relaying to ``server`` whoever
    proves the job's secret (:mod:`disttrain.trainer.store.front`)."""
    from disttrain.trainer.store import channel, front

    secret = storeauth.secret_from_env()
    if not secret:
        raise channel.MissingSecret(f"the agent has no store secret (${env.STORE_SECRET_FILE}): no front, no store")
    gate = front.StoreFront((host, port), ("127.0.0.1", int(server.port)), secret)
    gate.start()
    return gate


def _same_group(report: keys.ProgressReport, status: dict[str, Any]) -> bool:
    """Whether ``report`` comes from the group the status describes: the same size and the same rank 0 start-up
    stamps (times of that one process's start, which no other group shares). An agent started after its
    predecessor was lost reads the group that trained on through the loss, which must not count as a new round."""
    startup = report.startup
    if startup is None or not status.get("workerStartup"):
        return False
    same_size = int(status.get("worldSize") or 0) == report.world_size
    return same_size and status.get("workerStartup") == startup.model_dump(by_alias=True, exclude_none=True)


def _rendezvous_rejections(guard: guardian.Guardian) -> Callable[[], int]:
    """The guardian's count of rejected rendezvous keys (deleted, garbled, replayed), for the silence rule."""
    return lambda: sum(n for (key_class, _reason), n in guard.counts().items() if key_class == "rendezvous")


def scoped_store(server: Any) -> Any:
    """The agent's own view of its store: inside the job's secret key namespace, as every worker sees it."""
    from disttrain.trainer.store import channel  # imports torch

    return channel.scoped(server)


def start_guardian(port: int, store: Any, host: str = "127.0.0.1") -> Optional[guardian.Guardian]:
    """The store's sweeper on a connection of its own (its reads of up to 8 MiB never queue the agent's
    requests behind them), checking values with the secret and job UID the agent's signed ``store`` seals with;
    None, with a warning, when the agent has no store secret to check values with."""
    from torch.distributed import TCPStore  # imported here: the module imports no torch

    from disttrain.trainer.store import channel

    secret = storeauth.secret_from_env()
    signed = channel.signed_of(store)
    if not secret or signed is None:
        log.warning("no store secret ($%s): the store is not guarded", env.STORE_SECRET_FILE)
        return None
    job_uid = signed.job_uid
    client = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    guard = guardian.Guardian(client, secret, job_uid)
    guard.start()
    return guard


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttrain.trainer.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=29400, help="TCPStore port (spec.rendezvous.port)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--state-dir", help="local mode: follow <dir>/job.json instead of the Kubernetes API")
    parser.add_argument("--namespace", default=os.environ.get(env.JOB_NAMESPACE, "default"))
    parser.add_argument("--name", default=os.environ.get(env.JOB_NAME))
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=0.1,
        help="how often the store is read for progress, checkpoints, failures and the nodes' beats",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.state_dir:
        source: JobSource = FileJobSource(args.state_dir)
    elif args.name:
        source = KubeJobSource(args.namespace, args.name)
    else:
        parser.error(f"--name (or ${env.JOB_NAME}) or --state-dir is required")
    guardian.pin_mmap_threshold()  # before the server's first large value: see the guardian's docstring
    fronted = os.environ.get(env.STORE_FRONT, "1") != "0"
    server = start_store() if fronted else start_store(args.port, args.host)
    if not fronted:  # only what the operator's pods say (bench/store_front.py's "without" runs)
        log.warning("$%s=0: the store is served on its port without the front: any client reaches it", env.STORE_FRONT)
    store = scoped_store(server)
    guard = start_guardian(int(server.port), store)
    gate = start_front(args.host, args.port, server) if fronted else None
    agent = Agent(source, store, poll_seconds=args.poll_seconds, guard=guard)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop_event.set())
    log.info("agent for %s serving the store on %s:%d", args.name or args.state_dir, args.host, args.port)
    renewer = _start_lease(source)
    pulser = _start_pulse()
    try:
        return agent.run()
    finally:
        if gate is not None:
            gate.stop()
        if pulser is not None:
            pulser.stop()
        if renewer is not None:
            renewer.stop()
        if guard is not None:
            guard.stop()


def _start_pulse() -> Optional[pulse.PulseServer]:
    """Serve the pulse the operator asked for (``$DISTTRAIN_AGENT_PULSE_PORT``) on the pod's IP; once the store
    serves, like the Lease, so a pulse also says the store is up."""
    try:
        port = int(os.environ.get(env.AGENT_PULSE_PORT) or 0)
        period = float(os.environ.get(env.AGENT_PULSE_SECONDS) or constants.AGENT_PULSE_SECONDS)
    except ValueError:
        log.warning("$%s or $%s is not a number: no pulse", env.AGENT_PULSE_PORT, env.AGENT_PULSE_SECONDS)
        return None
    host, uid = os.environ.get(env.POD_IP) or "0.0.0.0", os.environ.get(env.POD_UID) or ""
    return pulse.start(host, port, uid, period, _pulse_key(os.environ.get(env.AGENT_PULSE_KEY_FILE) or ""))


def _pulse_key(path: str) -> Optional[bytes]:
    """The job's pulse key from the file the operator mounted (its Secret's ``pulse-key``); None when there is none."""
    if not path:
        return None
    try:
        with open(path, encoding="ascii") as file:
            return pulse_wire.parse_key(file.read())
    except (OSError, ValueError) as exc:
        log.warning("the pulse key at %s cannot be read: %s", path, exc)
        return None


def _start_lease(source: JobSource) -> Optional[lease.LeaseRenewer]:
    """Renew the Lease the operator named (Kubernetes only; an older operator names none)."""
    name, holder = os.environ.get(env.AGENT_LEASE), os.environ.get(env.POD_UID)
    if not isinstance(source, KubeJobSource) or not name or not holder:
        return None
    coordination = _kubernetes().client.CoordinationV1Api(source.api.api_client)
    try:
        renew_s = float(os.environ.get(env.AGENT_LEASE_RENEW_SECONDS) or constants.AGENT_LEASE_RENEW_SECONDS)
    except ValueError:
        renew_s = constants.AGENT_LEASE_RENEW_SECONDS
    renewer = lease.LeaseRenewer(coordination, source.namespace, name, holder, renew_s if renew_s > 0 else 1.0)
    renewer.start()
    return renewer
