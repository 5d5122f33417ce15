"""The worker contract carries the GPUs the trainer container requests, so the trainer can refuse a CPU run."""

from __future__ import annotations

from typing import Any

import pytest
from tests.conftest import JobBuilder

from disttrain.api.contract import WorkerContract, missing_gpu_message, requested_gpus
from disttrain.api.spec import DistTrainJob


def _job(resources: Any, containers: Any = None) -> DistTrainJob:
    builder = JobBuilder("gpu")
    if containers is None:
        containers = [{"name": "trainer", "image": "t:1", "command": ["python", "train.py"], "resources": resources}]
    builder.set("spec.template.spec.containers", containers)
    return DistTrainJob.model_validate(builder.build())


@pytest.mark.parametrize(
    ("resources", "gpus"),
    [
        ({}, 0),
        ({"limits": {"cpu": "4", "memory": "8Gi"}}, 0),
        ({"limits": {"nvidia.com/gpu": 8}}, 8),
        ({"limits": {"nvidia.com/gpu": "4"}, "requests": {"nvidia.com/gpu": "4"}}, 4),
        ({"requests": {"nvidia.com/gpu": 2}}, 2),
        ({"limits": {"amd.com/gpu": 1}}, 1),
        ({"limits": {"nvidia.com/gpu": "lots"}}, 0),
    ],
    ids=["none", "cpu-only", "nvidia-limit", "string-quantity", "request-only", "amd", "unreadable"],
)
def test_the_contract_counts_the_trainer_containers_gpus(resources, gpus):
    contract = WorkerContract.from_spec(_job(resources).spec)
    assert contract.gpus_per_node == gpus
    assert WorkerContract.from_env_value(contract.to_env_value()).gpus_per_node == gpus


def test_only_the_trainer_container_counts():
    sidecar = {"name": "proxy", "image": "p:1", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    trainer = {"name": "trainer", "image": "t:1", "command": ["python", "train.py"]}
    job = _job(None, containers=[sidecar, trainer])
    assert WorkerContract.from_spec(job.spec).gpus_per_node == 0
    assert requested_gpus({"spec": {"containers": [sidecar, dict(sidecar, name="other")]}}) == 0  # no trainer


def test_a_contract_written_without_the_field_asks_for_no_gpus():
    old = '{"training": {"globalBatchSize": 4, "microBatchSize": 1, "lr": {"base": 0.1}, "maxSteps": 2}, '
    old += '"checkpoint": {"intervalSteps": 2}}'
    assert WorkerContract.from_env_value(old).gpus_per_node == 0


def test_the_missing_gpu_message_names_the_field_what_was_found_and_the_way_out():
    text = missing_gpu_message(8, "2.13.0+cpu", "CPU only", 0)
    assert "requests 8 GPU(s) per node" in text
    assert "spec.template.spec.containers[trainer].resources nvidia.com/gpu or amd.com/gpu" in text
    assert "torch 2.13.0+cpu (built for CPU only) sees 0 CUDA device(s)" in text
    assert "--device cpu" in text
