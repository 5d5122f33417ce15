"""Which container of a pod template runs the trainer: the one named ``trainer``, else the only one.

One rule for every reader: the spec (the agent pod copies the trainer's image), the pod builder (it wraps that
container's command in torchrun), the local runtime (it runs that container as a process) and validation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from disttrain.api import constants

NO_TRAINER_MESSAGE = (
    f"spec.template.spec.containers needs a container named {constants.TRAINER_CONTAINER!r} (or exactly one container)"
)


def find_trainer_index(containers: Sequence[Mapping[str, Any]]) -> Optional[int]:
    """Index of the trainer container, or None when there is none (several containers, none named ``trainer``)."""
    for index, container in enumerate(containers):
        if container.get("name") == constants.TRAINER_CONTAINER:
            return index
    return 0 if len(containers) == 1 else None


def trainer_index(containers: Sequence[Mapping[str, Any]]) -> int:
    """Index of the trainer container; ValueError naming the field when there is none."""
    index = find_trainer_index(containers)
    if index is None:
        raise ValueError(NO_TRAINER_MESSAGE)
    return index
