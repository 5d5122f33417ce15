"""Prometheus metrics of the operator: per job (labels ``namespace``, ``job``) and of the operator itself.

Per-job values are derived from the job's status after each reconcile, so they are exactly what ``kubectl get
dtj -o yaml`` shows. Restarts and reforms are real counters advanced by the difference between the previous
and the new status value (the first sight of a job only creates the series), so a restarted operator starts
them from 0, as Prometheus' rate() expects. Every restart and reform reason's counter and the reform-duration
histogram exist (at 0) from the job's first sight: Prometheus' increase() only sees a counter's 0 -> 1 when the 0
was scraped, so a series created at 1 would hide the job's first restart, reform or reform duration of that kind
from every dashboard panel built on increase().
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from disttrain.api import conditions as cond
from disttrain.api.conditions import Reason
from disttrain.api.goodput import Cause
from disttrain.api.reformphases import ReformPhase
from disttrain.api.status import STORE_KEY_CLASSES, STORE_REJECT_REASONS, Phase
from disttrain.operator.infralosses import INFRASTRUCTURE_CAUSES, WINDOW_SECONDS

PHASES = [p.value for p in Phase]
REFORM_PHASES = tuple(p.value for p in ReformPhase)
"""The ``phase`` label of the reform-phase histogram: the keys of status.lastReform.phases."""
RESTART_REASONS = tuple(
    r.value
    for r in (
        Reason.NODE_LOST,
        Reason.POD_FAILED,
        Reason.POD_DELETED,
        Reason.EVICTED,
        Reason.NODE_NOT_READY,
        Reason.NODE_UNREACHABLE,
        Reason.NODE_DELETED,
        Reason.NODE_DRAINING,
        Reason.HEARTBEAT_LOST,
        Reason.STEP_STALLED,
        Reason.AGENT_RESTARTED,
    )
)
"""Causes of an unplanned loss: the keys of status.restarts.byReason (the reconcile core's LOSS_REASONS)."""
INFRASTRUCTURE_REASONS = tuple(sorted(r.value for r in INFRASTRUCTURE_CAUSES))
"""Causes of an infrastructure loss: the keys of status.infrastructureLosses.byReason."""
REFORM_REASONS = (*RESTART_REASONS, Reason.SCALED_DOWN.value, Reason.SCALED_UP.value, Reason.NODE_DEPARTING.value)
"""Reasons a reform starts with: every restart cause, the planned scale-down and scale-up, and a node's departure."""
GOODPUT_CAUSES = tuple(c.value for c in Cause)
"""The ``cause`` label of the goodput counter: the keys of status.goodput.seconds."""
MAX_DELETED_REMEMBERED = 10_000
OTHER_REASON = "Other"
"""The label of any reason that is not one of ours: label values come only from our enums, never from a status
value as such (a status field is no place to mint new time series, nor to inject text into /metrics)."""


def reason_label(reason: Any, known: tuple[str, ...]) -> str:
    """``reason`` when it is one of ``known``, else :data:`OTHER_REASON`."""
    return reason if isinstance(reason, str) and reason in known else OTHER_REASON


class OperatorMetrics:
    """All metrics in one object so tests can use a private registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        job = ["namespace", "job"]
        self.world_size = Gauge(
            "disttrain_job_world_size", "Processes in the job's current group.", job, registry=registry
        )
        self.desired_nodes = Gauge(
            "disttrain_job_desired_nodes", "Node count the operator works towards.", job, registry=registry
        )
        self.phase = Gauge(
            "disttrain_job_phase",
            "1 for the job's current phase, 0 for the others.",
            [*job, "phase"],
            registry=registry,
        )
        self.restarts = Counter(
            "disttrain_job_restarts",
            "Failures restarted (counted against maxRestarts).",
            [*job, "reason"],
            registry=registry,
        )
        self.restarts_counted = Gauge(
            "disttrain_job_restarts_counted",
            "Restarts counted against spec.restartPolicy.maxRestarts "
            "(status.restarts.total; unlike the counter, it survives an operator restart).",
            job,
            registry=registry,
        )
        self.max_restarts = Gauge(
            "disttrain_job_max_restarts",
            "The job's restart budget, spec.restartPolicy."
            "maxRestarts: once this many were counted, the next incident fails the job.",
            job,
            registry=registry,
        )
        self.infrastructure_losses = Counter(
            "disttrain_job_infrastructure_losses",
            "Losses of infrastructure the job survived (status.infrastructureLosses): nodes lost, pods evicted or "
            "deleted, nodes departing, the job agent lost. Not counted against maxRestarts.",
            [*job, "reason"],
            registry=registry,
        )
        self.infrastructure_losses_last_hour = Gauge(
            "disttrain_job_infrastructure_losses_last_hour",
            "Infrastructure losses within the last hour (status.infrastructureLosses.recent), the count "
            "spec.restartPolicy.maxInfrastructureLossesPerHour bounds.",
            job,
            registry=registry,
        )
        self.max_infrastructure_losses_per_hour = Gauge(
            "disttrain_job_max_infrastructure_losses_per_hour",
            "spec.restartPolicy.maxInfrastructureLossesPerHour: one more loss within an hour fails the job.",
            job,
            registry=registry,
        )
        self.agent_replacements = Counter(
            "disttrain_job_agent_replacements",
            "Job agent pods lost and recreated (status.agentLostAt set anew). No restart: the workers train on and "
            "reconnect to the new agent.",
            job,
            registry=registry,
        )
        self.reforms = Counter(
            "disttrain_job_reforms", "Group reforms (planned and unplanned).", [*job, "reason"], registry=registry
        )
        self.stalls = Counter(
            "disttrain_stalls",
            "Nodes evicted for a stalled step: their ranks did not reach a step's gradient reduction while their "
            "peers waited there (status.stalls; spec.elastic.stallFactor).",
            job,
            registry=registry,
        )
        self.reform_duration = Histogram(
            "disttrain_job_reform_duration_seconds",
            "Seconds from a drain/reform directive to the first step at the new size.",
            job,
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.reform_phase = Histogram(  # by namespace, not by job: a job's own phases are in its status
            "disttrain_job_reform_phase_seconds",
            "Seconds of each phase of a reform (status.lastReform.phases), over the namespace's jobs: detection, "
            "directive, restart, imports, modelBuild, processGroup, checkpointLoad, firstStep.",
            ["namespace", "phase"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self.checkpoint_step = Gauge(
            "disttrain_job_last_complete_checkpoint_step",
            "Step of the newest complete checkpoint.",
            job,
            registry=registry,
        )
        self.checkpoint_age = Gauge(
            "disttrain_job_checkpoint_age_seconds",
            "Seconds since the newest complete checkpoint was committed.",
            job,
            registry=registry,
        )
        self.samples = Gauge(
            "disttrain_job_samples_consumed", "Samples consumed by the training so far.", job, registry=registry
        )
        self.store_rejections = Counter(
            "disttrain_store_rejected_values",
            "Values the job agent rejected in its store (status.storeRejections): keys outside the job's "
            "namespace, unsigned or replayed values, valid values deleted. Anything above 0 means something "
            "without the job's secret writes to the store (alert on > 0: a series appears with the job's first "
            "rejection of its kind, not at 0, to keep 16 series per job out of every healthy job's memory).",
            [*job, "key_class", "reason"],
            registry=registry,
        )
        self.goodput_seconds = Counter(
            "disttrain_job_goodput_seconds",
            "Seconds of the job's wall time by cause (status.goodput.seconds; docs/observability.md, \"Goodput by "
            'cause"): training, queued, startup, suspended, each reform phase, reform, redone, checkpointBlocked, '
            "stalled, finishing. Advanced when the operator settles them, so it lags the wall clock by up to "
            "a few minutes.",
            [*job, "cause"],
            registry=registry,
        )
        self.goodput_ratio = Gauge(
            "disttrain_job_goodput_ratio",
            "Training seconds / wall seconds over the job's life (status.goodput.ratio).",
            job,
            registry=registry,
        )
        self.reconcile_duration = Histogram(
            "disttrain_operator_reconcile_duration_seconds",
            "Wall time of one reconcile (read, decide, write).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )
        self.errors = Counter(
            "disttrain_operator_reconcile_errors", "Reconciles that failed (retried).", ["kind"], registry=registry
        )
        self._seen: dict[tuple[str, str], dict[str, Any]] = {}
        self._deleted: dict[str, None] = {}
        """uids of jobs whose deletion began (insertion-ordered, bounded): a late reconcile of one of them must
        not bring its series back."""

    def observe_job(
        self,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        now: Optional[float] = None,
        *,
        max_restarts: Optional[int] = None,
        max_infrastructure_losses_per_hour: Optional[int] = None,
        uid: Optional[str] = None,
    ) -> None:
        """Update the job's series from its status (call after every reconcile); ``max_restarts`` and
        ``max_infrastructure_losses_per_hour`` are the spec's budgets, which the status does not carry. Nothing
        happens for a job (``uid``) being deleted."""
        if uid and uid in self._deleted:
            return
        now = time.time() if now is None else now
        labels = (namespace, name)
        if labels not in self._seen:
            self._create_series_at_zero(labels)
        self._observe_budgets(labels, max_restarts, max_infrastructure_losses_per_hour)
        self.restarts_counted.labels(*labels).set((status.get("restarts") or {}).get("total", 0))
        self.world_size.labels(*labels).set(status.get("worldSize", 0))
        self.desired_nodes.labels(*labels).set(status.get("desiredNodes", 0))
        for phase in PHASES:
            self.phase.labels(*labels, phase).set(1 if status.get("phase") == phase else 0)
        self.samples.labels(*labels).set(status.get("samplesConsumed", 0))
        ckpt = status.get("lastCheckpoint") or {}
        if ckpt:
            self.checkpoint_step.labels(*labels).set(ckpt.get("step", 0))
            committed = cond.parse_time(ckpt.get("time"))
            if committed is not None:  # computed when scraped: a job that stops progressing is reconciled no more
                self.checkpoint_age.labels(*labels).set_function(lambda: max(0.0, time.time() - committed))
        previous = self._seen.get(labels)
        by_reason = (status.get("restarts") or {}).get("byReason") or {}
        old_by_reason = ((previous or {}).get("restarts") or {}).get("byReason") or {}
        for reason, count in _by_label(by_reason, RESTART_REASONS).items():
            delta = count - _by_label(old_by_reason, RESTART_REASONS).get(reason, 0) if previous is not None else 0
            self.restarts.labels(*labels, reason)  # the series exists from the first sight
            if delta > 0:
                self.restarts.labels(*labels, reason).inc(delta)
        self._observe_infrastructure_losses(labels, status, previous)
        agent_lost_at = status.get("agentLostAt")
        if previous is not None and agent_lost_at is not None and agent_lost_at != previous.get("agentLostAt"):
            self.agent_replacements.labels(*labels).inc()
        stalls = status.get("stalls", 0)
        if previous is not None and isinstance(stalls, int) and stalls > previous.get("stalls", 0):
            self.stalls.labels(*labels).inc(stalls - previous.get("stalls", 0))
        reform = status.get("lastReform") or {}
        old_reform = (previous or {}).get("lastReform") or {}
        if previous is not None and status.get("reforms", 0) > previous.get("reforms", 0):
            added = status["reforms"] - previous.get("reforms", 0)
            self.reforms.labels(*labels, reason_label(reform.get("reason"), REFORM_REASONS)).inc(added)
        if reform.get("durationSeconds") is not None and (reform.get("start"), reform.get("durationSeconds")) != (
            old_reform.get("start"),
            old_reform.get("durationSeconds"),
        ):
            self.reform_duration.labels(*labels).observe(reform["durationSeconds"])
            phases = reform.get("phases") or {}
            for phase in REFORM_PHASES:
                if isinstance(phases.get(phase), (int, float)):
                    self.reform_phase.labels(namespace, phase).observe(phases[phase])
        self._observe_store_rejections(labels, status, previous)
        goodput = _goodput_seconds(status)
        self._observe_goodput(labels, status, goodput, previous)
        self._seen[labels] = {
            "goodput": goodput,
            "storeRejections": _store_rejection_counts(status),
            "restarts": status.get("restarts"),
            "infrastructureLosses": status.get("infrastructureLosses"),
            "reforms": status.get("reforms", 0),
            "stalls": stalls if isinstance(stalls, int) else 0,
            "lastReform": reform,
            "agentLostAt": agent_lost_at,
        }

    def _observe_budgets(
        self, labels: tuple[str, str], max_restarts: Optional[int], max_infrastructure_losses: Optional[int]
    ) -> None:
        """The spec's two budgets, when the caller knows them."""
        if max_restarts is not None:
            self.max_restarts.labels(*labels).set(max_restarts)
        if max_infrastructure_losses is not None:
            self.max_infrastructure_losses_per_hour.labels(*labels).set(max_infrastructure_losses)

    def _observe_infrastructure_losses(
        self, labels: tuple[str, str], status: Mapping[str, Any], previous: Optional[Mapping[str, Any]]
    ) -> None:
        """Advance the counter by what byReason grew (a loss taken back, an incident that turned out to be the
        user's code, stays counted: a counter never goes down); the last-hour gauge counts the window's times when
        scraped, so it falls as they age even while the job is not reconciled."""
        counts = status.get("infrastructureLosses") or {}
        by_reason = _by_label(counts.get("byReason") or {}, INFRASTRUCTURE_REASONS)
        old = _by_label(
            ((previous or {}).get("infrastructureLosses") or {}).get("byReason") or {}, INFRASTRUCTURE_REASONS
        )
        for reason, count in by_reason.items():
            delta = count - old.get(reason, 0) if previous is not None else 0
            if delta > 0:
                self.infrastructure_losses.labels(*labels, reason).inc(delta)
        times = [t for t in (_parse_time(v) for v in counts.get("recent") or ()) if t is not None]
        self.infrastructure_losses_last_hour.labels(*labels).set_function(
            lambda: sum(1 for t in times if time.time() - t < WINDOW_SECONDS)
        )

    def _observe_store_rejections(
        self, labels: tuple[str, str], status: Mapping[str, Any], previous: Optional[Mapping[str, Any]]
    ) -> None:
        """Advance the counter by what the agent's counts grew since the last status (the first sight of a job
        only creates the series, as for restarts); a count below the last one is a restarted agent counting from
        0 again (all of it is new)."""
        if previous is None:
            return
        counts = _store_rejection_counts(status)
        old = previous.get("storeRejections") or {}
        for series, count in counts.items():
            before = old.get(series, 0)
            delta = count - before if count >= before else count
            if delta > 0:
                self.store_rejections.labels(*labels, *series).inc(delta)

    def _observe_goodput(
        self,
        labels: tuple[str, str],
        status: Mapping[str, Any],
        seconds: dict[str, float],
        previous: Optional[Mapping[str, Any]],
    ) -> None:
        """Advance each cause's counter by what status.goodput.seconds grew since the last status (the first sight
        of a job only creates the series)."""
        ratio = (status.get("goodput") or {}).get("ratio")
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
            self.goodput_ratio.labels(*labels).set(ratio)
        if previous is None:
            return
        old = previous.get("goodput") or {}
        for cause, value in seconds.items():
            delta = value - old.get(cause, 0.0)
            if delta > 0:
                self.goodput_seconds.labels(*labels, cause).inc(delta)

    def _create_series_at_zero(self, labels: tuple[str, str]) -> None:
        """Every reason's counter and the reform-duration histogram at 0, so that increase() sees the first
        restart, reform and reform duration of each kind."""
        self.reform_duration.labels(*labels)
        self.stalls.labels(*labels)
        self.agent_replacements.labels(*labels)
        self.infrastructure_losses_last_hour.labels(*labels)
        for reason in (*INFRASTRUCTURE_REASONS, OTHER_REASON):
            self.infrastructure_losses.labels(*labels, reason)
        for phase in REFORM_PHASES:
            self.reform_phase.labels(labels[0], phase)
        for reason in (*RESTART_REASONS, OTHER_REASON):
            self.restarts.labels(*labels, reason)
        for reason in (*REFORM_REASONS, OTHER_REASON):
            self.reforms.labels(*labels, reason)
        for cause in GOODPUT_CAUSES:
            self.goodput_seconds.labels(*labels, cause)

    def forget_job(self, namespace: str, name: str, uid: Optional[str] = None) -> None:
        """Drop a deleted job's series so /metrics does not grow without bound. Call it as soon as the deletion
        begins: a job can stay in deletion for minutes (foreground deletion waiting for pods on a lost node), and
        its frozen series would claim it still runs. With ``uid``, later :meth:`observe_job` calls for that job
        (a reconcile that was already under way) are ignored."""
        if uid:
            self._deleted[uid] = None
            while len(self._deleted) > MAX_DELETED_REMEMBERED:
                del self._deleted[next(iter(self._deleted))]
        labels = (namespace, name)
        self._seen.pop(labels, None)
        for metric in (
            self.world_size,
            self.desired_nodes,
            self.checkpoint_step,
            self.checkpoint_age,
            self.samples,
            self.reform_duration,
            self.stalls,
            self.agent_replacements,
            self.restarts_counted,
            self.max_restarts,
            self.infrastructure_losses_last_hour,
            self.max_infrastructure_losses_per_hour,
            self.goodput_ratio,
        ):
            try:
                metric.remove(*labels)
            except KeyError:
                pass
        for family in (
            self.phase,
            self.restarts,
            self.infrastructure_losses,
            self.reforms,
            self.store_rejections,
            self.goodput_seconds,
        ):
            for sample_labels in list(family._metrics):  # prometheus-client has no public lister
                if sample_labels[:2] == labels:
                    family.remove(*sample_labels)


def _parse_time(value: Any) -> Optional[float]:
    """An RFC 3339 time of the status as Unix time; None for anything else (a status field never breaks /metrics)."""
    try:
        return cond.parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _store_rejection_counts(status: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    """``status.storeRejections.counts`` by (key class, reason); anything outside the closed label sets, or no
    non-negative integer, is left out (a status field never mints a series)."""
    counts = (status.get("storeRejections") or {}).get("counts") or {}
    out: dict[tuple[str, str], int] = {}
    if not isinstance(counts, Mapping):
        return out
    for name, count in counts.items():
        key_class, _, reason = str(name).partition("/")
        if key_class not in STORE_KEY_CLASSES or reason not in STORE_REJECT_REASONS:
            continue
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            out[(key_class, reason)] = count
    return out


def _goodput_seconds(status: Mapping[str, Any]) -> dict[str, float]:
    """``status.goodput.seconds`` by cause; anything outside :data:`GOODPUT_CAUSES` or no finite non-negative number
    is left out."""
    seconds = (status.get("goodput") or {}).get("seconds") or {}
    if not isinstance(seconds, Mapping):
        return {}
    return {
        cause: float(value)
        for cause, value in seconds.items()
        if cause in GOODPUT_CAUSES
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value < float("inf")
    }


def _by_label(by_reason: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, int]:
    """Counts per label: unknown reasons summed under :data:`OTHER_REASON`, counts that are no integer skipped."""
    out: dict[str, int] = {}
    for reason, count in by_reason.items():
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            label = reason_label(reason, known)
            out[label] = out.get(label, 0) + count
    return out
