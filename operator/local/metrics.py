"""Operator-side Prometheus metrics of a local run, served on localhost while it runs.

The operator's own :class:`~disttrain.operator.metrics.OperatorMetrics` (same names and labels as on a cluster,
fed from the job status after every reconcile) on a private registry, plus three gauges the live display and
the e2e tests read: the step and the plan's global batch and LR scale. The workers serve their own exporters
(``disttrain_trainer_*``) on the ports the runtime gave them through ``DISTTRAIN_METRICS_PORT``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import prometheus_client as prom

from disttrain.common import httpserver
from disttrain.operator.metrics import OperatorMetrics


class LocalMetrics:
    def __init__(self, namespace: str, job: str) -> None:
        self.namespace, self.job = namespace, job
        r = self.registry = prom.CollectorRegistry()
        self.operator = OperatorMetrics(registry=r)
        names = ["namespace", "job"]
        self.step = prom.Gauge("disttrain_job_step", "Last completed optimizer step.", names, registry=r)
        self.global_batch = prom.Gauge(
            "disttrain_job_global_batch", "Samples per optimizer step in the current plan.", names, registry=r
        )
        self.lr_scale = prom.Gauge(
            "disttrain_job_lr_scale", "World-size LR factor of the current plan.", names, registry=r
        )
        self._server: Any = None

    def serve(self, port: int = 0) -> str:
        """Start the HTTP exporter on 127.0.0.1 (``port`` 0: a free one), bounded as the operator's is; returns its
        URL."""
        self._server = httpserver.serve_metrics(port, "127.0.0.1", self.registry)
        return f"http://127.0.0.1:{self._server.server_port}/metrics"

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe_reconcile(self, seconds: float) -> None:
        self.operator.reconcile_duration.observe(seconds)

    def observe_error(self, kind: str) -> None:
        self.operator.errors.labels(kind).inc()

    def observe(
        self,
        status: Mapping[str, Any],
        now: float,
        max_restarts: Optional[int] = None,
        max_infrastructure_losses_per_hour: Optional[int] = None,
    ) -> None:
        self.operator.observe_job(
            self.namespace,
            self.job,
            status,
            now,
            max_restarts=max_restarts,
            max_infrastructure_losses_per_hour=max_infrastructure_losses_per_hour,
        )
        labels = (self.namespace, self.job)
        self.step.labels(*labels).set(status.get("step", 0))
        plan = status.get("plan") or {}
        if plan:
            self.global_batch.labels(*labels).set(plan.get("globalBatch", 0))
            self.lr_scale.labels(*labels).set(plan.get("lrScale", 0))
