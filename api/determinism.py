"""``spec.training.deterministic``: the environment a deterministic run needs before CUDA starts.

cuBLAS picks its reduction splits by the workspace it has; with several workspaces per stream (its default) a
matmul's result may change from run to run. ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (eight 4 MiB buffers) fixes it, and
torch's deterministic mode refuses cuBLAS ops without it. cuBLAS reads it when a handle is created, in the worker's
first matmul, so it goes into the trainer container's env, where every worker starts with it. The trainer's
switch itself (``torch.use_deterministic_algorithms``) is :mod:`disttrain.trainer.determinism`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from disttrain.api.spec import TrainingSpec

CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_WORKSPACE = ":4096:8"
"""Eight 4 MiB cuBLAS workspaces per stream (32 MiB of GPU memory per stream that runs cuBLAS); ``:16:8`` would
save memory and cost speed."""


def container_env(training: TrainingSpec, user_env: Collection[str]) -> list[dict[str, Any]]:
    """The env entries a deterministic job adds to its trainer container; none when it is not deterministic or the
    container sets the variable itself (``user_env``: the names it sets)."""
    if not training.deterministic or CUBLAS_WORKSPACE_CONFIG in user_env:
        return []
    return [{"name": CUBLAS_WORKSPACE_CONFIG, "value": DETERMINISTIC_WORKSPACE}]
