"""What a worker pod of :func:`disttrain.operator.pods.build_worker_pod` runs, read back for tests: the trainer
container's argv and its literal env."""

from __future__ import annotations

from typing import Any

from disttrain.operator.pods import trainer_container


def worker_command(pod: dict[str, Any]) -> list[str]:
    """argv of a worker pod's trainer container (``python -m disttrain.trainer.launch ... <training command>``)."""
    return list(trainer_container(pod)["command"])


def worker_env_dict(pod: dict[str, Any]) -> dict[str, str]:
    """The literal env of a worker pod's trainer container (valueFrom entries are skipped)."""
    return {e["name"]: e["value"] for e in trainer_container(pod).get("env") or [] if "value" in e}
