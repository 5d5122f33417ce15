"""Shared fixtures: the repository root and a fluent builder of DistTrainJob manifests."""

from __future__ import annotations

import copy
import pathlib
import sys
from collections.abc import Iterator
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

    def nodes(self, min: int, max: int, replicas: int) -> JobBuilder:
        self.obj["spec"]["nodes"] = {"min": min, "max": max, "replicas": replicas}
        return self

    def set(self, dotted: str, value: Any) -> JobBuilder:
        node = self.obj
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        return self

    def delete(self, dotted: str) -> JobBuilder:
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


TIERS: dict[str, str] = {
    "unit": "pure logic and single-process tests: seconds, the inner loop (`make test-unit`)",
    "operator": "the kopf operator against the kmock API emulator, in process and as a process",
    "trainer": "real multi-process torchrun jobs on gloo, with real process kills (tests/trainer, tests/agent)",
    "e2e": "`disttrain local run` end to end: the same manifest, agent and launcher as on a cluster",
    "cluster": "the real control plane in ../shared/k8s/: apiserver, etcd, the tests as kubelets",
    "chart": "the Helm chart rendered, linted and checked (RBAC, pod security, alert rules, dashboard)",
    "security": "a secretless outsider attacks a real local job's store",
    "images": "the container images built with buildah (`make test-images`)",
}
"""The test tiers, one pytest marker each, given by the folder a test is in (:data:`TIER_OF_FOLDER`)."""

TIER_OF_FOLDER: dict[str, str] = {
    "unit": "unit",
    "operator": "operator",
    "trainer": "trainer",
    "agent": "trainer",
    "e2e": "e2e",
    "cluster": "cluster",
    "chart": "chart",
    "security": "security",
    "images": "images",
}


STORE_CLOSE_JOIN_S = 15.0
"""Longest wait for a reconnection attempt in flight: torch's connect retries within the client's 4-10 s timeout."""


@pytest.fixture(autouse=True)
def _close_the_tests_store_clients() -> Iterator[None]:
    """Stop the reconnection of every store client a test made in this process once it ends. Left running, one
    kept probing its server's port after the server was gone, connected to whatever later listened there, and was
    inside torch's C++ connect when pytest exited: the interpreter aborted (``terminate called without an active
    exception``) after every test had passed."""
    resilient = sys.modules.get("disttrain.trainer.store.resilient")
    before = set(resilient._ALL) if resilient is not None else set()
    yield
    resilient = sys.modules.get("disttrain.trainer.store.resilient")
    if resilient is not None:
        for store in set(resilient._ALL) - before:
            store.close(join_s=STORE_CLOSE_JOIN_S)


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier; a test outside a tier's folder is an error (no test escapes every tier)."""
    tests_dir = pathlib.Path(__file__).resolve().parent
    for item in items:
        folder = pathlib.Path(str(item.path)).resolve().relative_to(tests_dir).parts[0]
        tier = TIER_OF_FOLDER.get(folder)
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: tests/{folder}/ belongs to no tier; add it to TIER_OF_FOLDER")
        others = {mark.name for mark in item.iter_markers() if mark.name in TIERS and mark.name != tier}
        if others:
            raise pytest.UsageError(f"{item.nodeid}: in the {tier} tier (its folder) but also marked {sorted(others)}")
        item.add_marker(getattr(pytest.mark, tier))
