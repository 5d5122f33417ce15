"""Local nodes on a machine with GPUs: each node gets GPUs of its own (disjoint ``CUDA_VISIBLE_DEVICES``), a node
that finds none free waits for a node's processes to end, and a run that cannot fit is refused naming the numbers.

The runtime tests start real process trees with the pod's environment (a stand-in program that prints its
``CUDA_VISIBLE_DEVICES`` instead of the launcher, which would need a job agent); the probe of the machine's GPUs is
the only thing given."""

from __future__ import annotations

import sys
import time

import pytest
from tests.unit.operator.world import job_manifest

from disttrain.api.spec import DistTrainJob
from disttrain.operator.local import cli, forkserver, gpucheck, gpuslices, proctree, runtime
from disttrain.operator.local.gpuslices import GpuSlices
from disttrain.operator.local.statedir import StateDir
from disttrain.operator.observed import WorkerCreation


def make_job(replicas: int = 2, nproc: int = 1, gpus: int = 0, env: list[dict[str, str]] = ()) -> DistTrainJob:
    manifest = job_manifest(replicas=replicas, nprocPerNode=nproc)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    container["env"] = list(env)
    return DistTrainJob.model_validate(manifest)


def test_slices_are_disjoint_and_a_released_one_is_given_again():
    slices = GpuSlices(("0", "1", "2", "3", "4"), 2)
    assert slices.capacity == 2
    assert slices.take("a") == ("0", "1")
    assert slices.take("b") == ("2", "3")
    assert slices.take("a") == ("0", "1"), "a node keeps its slice"
    assert slices.take("c") is None, "one GPU left, a node needs two"
    slices.release("a")
    assert slices.take("c") == ("0", "1")


def test_the_machines_gpus_are_the_entries_of_the_mask_torch_counted():
    assert gpuslices.visible_devices(None, 3) == ("0", "1", "2")
    assert gpuslices.visible_devices("4,5,6,7", 4) == ("4", "5", "6", "7")
    assert gpuslices.visible_devices("GPU-a1, GPU-b2", 2) == ("GPU-a1", "GPU-b2")
    assert gpuslices.visible_devices("2,3,99", 2) == ("2", "3"), "CUDA stops at the first invalid entry"


def test_a_node_needs_its_gpu_request_else_one_gpu_per_process():
    assert gpuslices.gpus_per_node(make_job(nproc=4)) == 4
    assert gpuslices.gpus_per_node(make_job(nproc=2, gpus=8)) == 8


def test_too_few_gpus_is_refused_naming_what_is_visible_and_what_is_asked():
    message = gpuslices.shortage_message(("0", "1", "2"), None, 2, 2)
    assert message is not None
    assert "3 GPU(s) visible (CUDA_VISIBLE_DEVICES unset)" in message
    assert "2 node(s) x 2 GPU(s) per node = 4" in message
    assert "--nodes 1" in message
    assert gpuslices.shortage_message(("0", "1", "2", "3"), "0,1,2,3", 2, 2) is None
    none_fit = gpuslices.shortage_message(("0",), "3", 1, 2)
    assert none_fit is not None and "fewer than the 2 one local node needs" in none_fit


@pytest.fixture
def machine(monkeypatch):
    """A machine with four GPUs, as the probe of the nodes' torch would report it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpucheck, "machine_has_gpus", lambda patterns=(): True)
    monkeypatch.setattr(gpucheck, "probe_torch", lambda python="": gpucheck.TorchFacts("2.13.0", "CUDA 13.0", True, 4))


def test_the_cli_splits_the_gpus_between_the_nodes_or_refuses_with_the_numbers(machine):
    refused, slices = cli._check_device(make_job(replicas=2, nproc=2), "auto")
    assert refused is None and slices == GpuSlices(("0", "1", "2", "3"), 2)
    refused, slices = cli._check_device(make_job(replicas=3, nproc=2), "auto")
    assert slices is None and refused is not None and "3 node(s) x 2 GPU(s) per node = 6" in refused
    assert cli._check_device(make_job(replicas=3, nproc=2), "cpu") == (None, None)
    pinned = make_job(replicas=3, nproc=2, env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}])
    assert cli._check_device(pinned, "auto") == (None, None), "a job that pins its devices is left alone"


PRINT_DEVICES = "import os, time; print('devices=' + os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(60)"


def test_every_node_runs_on_its_own_gpus_and_a_node_without_a_free_slice_waits(tmp_path, monkeypatch):
    def stand_in(forks, argv, environ, cwd, output, marker, per_pod=()):
        return proctree.spawn([sys.executable, "-c", PRINT_DEVICES], environ, cwd, output, marker)

    monkeypatch.setattr(forkserver, "start_pod", stand_in)
    state = StateDir(tmp_path / "state")
    state.create()
    options = runtime.RunOptions(gpus=GpuSlices(("0", "1"), 1), workdir=str(tmp_path))
    rt = runtime.LocalRuntime(make_job(replicas=3), state, options)
    try:
        for index in range(3):
            rt.create_worker(WorkerCreation(index, f"demo-worker-{index}"))
        rt.create_worker(WorkerCreation(2, "demo-worker-2"))  # reconcile asks again at every tick
        assert sorted(rt.workers) == ["demo-worker-0", "demo-worker-1"]
        waits = [e for e in rt.events if e["reason"] == "NoFreeGpus"]
        assert len(waits) == 1 and "demo-worker-2 waits: 0 of this machine's 2 GPU(s) are free" in waits[0]["message"]
        assert _printed(state, "demo-worker-0") == "devices=0"
        assert _printed(state, "demo-worker-1") == "devices=1"

        lost = rt.workers["demo-worker-1"]
        lost.kill_machine()
        lost.deleting_since = time.time()
        rt.finish_deletions(time.time())
        rt.create_worker(WorkerCreation(2, "demo-worker-2"))
        assert "demo-worker-2" in rt.workers
        assert _printed(state, "demo-worker-2") == "devices=1", "the lost node's GPU, once its processes are gone"
    finally:
        rt.shutdown()
    assert rt.gpus is not None and rt.gpus.held == {}


def _printed(state: StateDir, name: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in state.log_file(name).read_text().splitlines() if line.startswith("devices=")]
        if lines:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError(f"{name} printed no devices: {state.log_file(name).read_text()!r}")
