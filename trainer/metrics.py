"""Per-worker Prometheus exporter (port ``$DISTTRAIN_METRICS_PORT + LOCAL_RANK``; 0 disables it).

A private registry so two trainers in one test process never collide. Job-level aggregates come from the agent.
"""

from __future__ import annotations

import logging

import prometheus_client as prom

from disttrain.common import httpserver

log = logging.getLogger("disttrain.trainer")


class TrainerMetrics:
    def __init__(self) -> None:
        r = self.registry = prom.CollectorRegistry()
        self.step = prom.Gauge("disttrain_trainer_step", "Optimizer steps completed", registry=r)
        self.samples_per_second = prom.Gauge(
            "disttrain_trainer_samples_per_second", "Global samples per second over the last step", registry=r
        )
        self.world_size = prom.Gauge("disttrain_trainer_world_size", "Processes in the current group", registry=r)
        self.accum_steps = prom.Gauge(
            "disttrain_trainer_grad_accum_steps", "Micro batches per optimizer step", registry=r
        )
        self.loss = prom.Gauge(
            "disttrain_trainer_loss",
            "Global loss of the last reported step: every rank's summed loss over the step's denominator "
            "(the global batch, or the global token count of a token-weighted loss); the same on every rank",
            registry=r,
        )
        self.lr_scale = prom.Gauge("disttrain_trainer_lr_scale", "World-size LR factor in effect (ramped)", registry=r)
        self.grad_norm = prom.Gauge(
            "disttrain_trainer_grad_norm", "Global gradient norm before clipping (set when clipping is on)", registry=r
        )
        self.save_seconds = prom.Histogram(
            "disttrain_trainer_checkpoint_save_seconds",
            "Checkpoint save time; phase=blocking (training stopped) or background",
            ["phase"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.last_complete_step = prom.Gauge(
            "disttrain_trainer_last_complete_checkpoint_step", "Step of the newest committed checkpoint", registry=r
        )
        self.checkpoint_uploads_pending = prom.Gauge(
            "disttrain_trainer_checkpoint_uploads_pending",
            "Saves of this rank committed on the local tier and not yet uploaded to the bucket (checkpoint.uri)",
            registry=r,
        )
        self.checkpoint_failures = prom.Counter(
            "disttrain_trainer_checkpoint_failures", "Checkpoint saves that failed", registry=r
        )
        self.resume_seconds = prom.Gauge(
            "disttrain_trainer_resume_seconds",
            "Seconds from process start to the first step after loading a checkpoint",
            registry=r,
        )
        self.samples_replayed = prom.Counter(
            "disttrain_trainer_samples_replayed", "Samples read twice across a resume (0 by construction)", registry=r
        )
        self.samples_skipped = prom.Counter(
            "disttrain_trainer_samples_skipped", "Samples never read across a resume (0 by construction)", registry=r
        )
        self.checkpoint_interval_steps = prom.Gauge(
            "disttrain_trainer_checkpoint_interval_steps",
            "Steps between checkpoints chosen by intervalSteps: auto (as the group agreed it)",
            registry=r,
        )
        self.restart_count = prom.Gauge(
            "disttrain_trainer_restart_count", "torchrun restarts of this worker", registry=r
        )

    def serve(self, port: int) -> bool:
        if port <= 0:
            return False
        try:
            httpserver.serve_metrics(port, registry=self.registry)  # bounded: connections and timeouts
        except OSError as exc:
            log.warning("metrics exporter disabled: cannot listen on port %d: %s", port, exc)
            return False
        return True
