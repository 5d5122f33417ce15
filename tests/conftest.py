"""Shared fixtures: the repository root and a fluent builder of DistTrainJob manifests."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


class JobBuilder:
    """Fluent builder of DistTrainJob manifests (wire form), in the style of Kubeflow's test wrappers."""

    def __init__(self, name: str = "demo") -> None:
        self.obj: dict[str, Any] = {
            "apiVersion": "disttrain.dev/v1alpha1",
            "kind": "DistTrainJob",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "trainer", "image": "example/trainer:1", "command": ["python", "train.py"]}
                        ]
                    }
                },
                "nodes": {"min": 1, "max": 4, "replicas": 2},
                "nprocPerNode": 1,
                "training": {
                    "globalBatchSize": 24,
                    "microBatchSize": 2,
                    "lr": {"base": 0.1},
                    "maxSteps": 100,
                },
                "checkpoint": {"claimName": "ckpt", "intervalSteps": 10},
            },
        }

    def nodes(self, min: int, max: int, replicas: int) -> "JobBuilder":
        self.obj["spec"]["nodes"] = {"min": min, "max": max, "replicas": replicas}
        return self

    def set(self, dotted: str, value: Any) -> "JobBuilder":
        node = self.obj
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        return self

    def delete(self, dotted: str) -> "JobBuilder":
        node = self.obj
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        del node[last]
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self.obj)


@pytest.fixture
def make_job() -> type[JobBuilder]:
    return JobBuilder
