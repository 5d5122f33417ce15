"""``spec.training.deterministic`` in the worker: torch's deterministic algorithms, switched on before any step.

The operator puts ``CUBLAS_WORKSPACE_CONFIG`` into the trainer container's env (:mod:`disttrain.api.determinism`);
a worker started without it (a plain ``python train.py``) gets it here, which works as long as this process has
not run a cuBLAS op yet (cuBLAS reads it when it creates its handle). Costs are in docs/gpu.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Optional

import torch

from disttrain.api import determinism
from disttrain.api.spec import TrainingSpec

log = logging.getLogger("disttrain.trainer")


def workspace_problem(environ: MutableMapping[str, str], cuda_started: bool) -> Optional[str]:
    """Set cuBLAS's deterministic workspace in ``environ`` when it is missing and CUDA has not started; a warning
    when it is missing and too late to set (None when nothing is wrong)."""
    if determinism.CUBLAS_WORKSPACE_CONFIG in environ:
        return None
    if not cuda_started:
        environ[determinism.CUBLAS_WORKSPACE_CONFIG] = determinism.DETERMINISTIC_WORKSPACE
        return None
    return (
        f"spec.training.deterministic: ${determinism.CUBLAS_WORKSPACE_CONFIG} was not set when CUDA started in this "
        f"process, so cuBLAS ops may raise under deterministic mode; set it to "
        f"{determinism.DETERMINISTIC_WORKSPACE} in the trainer container's env"
    )


def apply(training: TrainingSpec) -> bool:
    """Turn on deterministic algorithms when the job asks (``torch.use_deterministic_algorithms(True)``, cuDNN's
    autotuner off, so the same kernels are chosen every run); whether it did."""
    if not training.deterministic:
        return False
    problem = workspace_problem(os.environ, bool(torch.cuda.is_initialized()))  # type: ignore[no-untyped-call]
    if problem is not None:
        log.warning("%s", problem)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    log.info(
        "spec.training.deterministic: deterministic algorithms on (%s=%s)",
        determinism.CUBLAS_WORKSPACE_CONFIG,
        os.environ.get(determinism.CUBLAS_WORKSPACE_CONFIG, ""),
    )
    return True
