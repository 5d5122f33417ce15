"""Operator-side Prometheus metrics of a local run, served on localhost while it runs.

The same names as the operator's per-job metrics (``disttrain_*`` with ``namespace`` and ``job`` labels), fed
from the job status after every reconcile and from the events it emits. The workers serve their own
exporters (``disttrain_trainer_*``) on the ports the runtime gave them through ``DISTTRAIN_METRICS_PORT``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import prometheus_client as prom

from disttrain.api import conditions as cond
from disttrain.operator.observed import Event

PHASES = ("Pending", "Running", "Reforming", "Succeeded", "Failed", "Suspended")


class LocalMetrics:
    def __init__(self, namespace: str, job: str) -> None:
        self.labels = {"namespace": namespace, "job": job}
        names = ["namespace", "job"]
        r = self.registry = prom.CollectorRegistry()
        self.world_size = prom.Gauge("disttrain_job_world_size", "Processes in the current group", names, registry=r)
        self.desired_nodes = prom.Gauge("disttrain_job_desired_nodes", "Node count the operator works towards",
                                        names, registry=r)
        self.phase = prom.Gauge("disttrain_job_phase", "1 for the job's current phase", [*names, "phase"], registry=r)
        self.restarts = prom.Counter("disttrain_job_restarts", "Failures restarted, by reason", [*names, "reason"],
                                     registry=r)
        self.reforms = prom.Counter("disttrain_job_reforms", "Group reforms (planned and unplanned), by reason",
                                    [*names, "reason"], registry=r)
        self.reform_duration = prom.Histogram("disttrain_job_reform_duration_seconds",
                                              "Seconds from a reform directive to the first step at the new size",
                                              names, registry=r,
                                              buckets=(0.5, 1, 2, 3, 5, 7.5, 10, 15, 30, 60, 120, 300))
        self.last_checkpoint_step = prom.Gauge("disttrain_job_last_complete_checkpoint_step",
                                               "Step of the newest complete checkpoint", names, registry=r)
        self.checkpoint_age = prom.Gauge("disttrain_job_checkpoint_age_seconds",
                                         "Seconds since the newest complete checkpoint was committed", names,
                                         registry=r)
        self.samples = prom.Gauge("disttrain_job_samples_consumed", "Samples consumed so far", names, registry=r)
        self.global_batch = prom.Gauge("disttrain_job_global_batch", "Samples per optimizer step in the current plan",
                                       names, registry=r)
        self.lr_scale = prom.Gauge("disttrain_job_lr_scale", "World-size LR factor of the current plan", names,
                                   registry=r)
        self.step = prom.Gauge("disttrain_job_step", "Last completed optimizer step", names, registry=r)
        self.reconcile_seconds = prom.Histogram("disttrain_operator_reconcile_duration_seconds",
                                                "Time of one reconcile call", registry=r,
                                                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5))
        self.errors = prom.Counter("disttrain_operator_errors", "Errors while applying actions", registry=r)
        self._restarts_seen: dict[str, int] = {}
        self._reforms_seen = 0
        self._reform_recorded: Optional[str] = None
        for phase in PHASES:
            self.phase.labels(**self.labels, phase=phase).set(0)

    def serve(self, port: int = 0) -> str:
        """Start the HTTP exporter on 127.0.0.1 (``port`` 0: a free one); returns its URL."""
        server, _thread = prom.start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self._server = server
        return f"http://127.0.0.1:{server.server_port}/metrics"

    def shutdown(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def observe(self, status: Mapping[str, Any], events: Iterable[Event], now: float) -> None:
        labels = self.labels
        self.world_size.labels(**labels).set(status.get("worldSize", 0))
        self.desired_nodes.labels(**labels).set(status.get("desiredNodes", 0))
        current = status.get("phase", "Pending")
        for phase in PHASES:
            self.phase.labels(**labels, phase=phase).set(1 if phase == current else 0)
        by_reason = (status.get("restarts") or {}).get("byReason", {})
        for reason, count in by_reason.items():
            delta = count - self._restarts_seen.get(reason, 0)
            if delta > 0:
                self.restarts.labels(**labels, reason=reason).inc(delta)
            self._restarts_seen[reason] = count
        reform = status.get("lastReform") or {}
        if status.get("reforms", 0) > self._reforms_seen:
            self.reforms.labels(**labels, reason=reform.get("reason", "Unknown")).inc(
                status["reforms"] - self._reforms_seen)
            self._reforms_seen = status["reforms"]
        key = f"{reform.get('start')}|{reform.get('reason')}"
        if reform.get("durationSeconds") is not None and key != self._reform_recorded:
            self.reform_duration.labels(**labels).observe(reform["durationSeconds"])
            self._reform_recorded = key
        ckpt = status.get("lastCheckpoint")
        if ckpt:
            self.last_checkpoint_step.labels(**labels).set(ckpt.get("step", 0))
            committed = cond.parse_time(ckpt.get("time"))
            if committed is not None:
                self.checkpoint_age.labels(**labels).set(max(0.0, now - committed))
        self.samples.labels(**labels).set(status.get("samplesConsumed", 0))
        self.step.labels(**labels).set(status.get("step", 0))
        plan = status.get("plan") or {}
        if plan:
            self.global_batch.labels(**labels).set(plan.get("globalBatch", 0))
            self.lr_scale.labels(**labels).set(plan.get("lrScale", 0))
