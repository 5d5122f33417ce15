"""`disttrain convert`: Kubeflow PyTorchJobs (shapes of Kubeflow's documented examples) become valid DistTrainJobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.conftest import REPO_ROOT

from disttrain.api import validation
from disttrain.operator import convert

DATA = REPO_ROOT / "tests" / "data" / "pytorchjob"
CONTRACT = convert.Contract(
    global_batch_size=512, micro_batch_size=2, lr=0.001, max_steps=1000, checkpoint_claim="ckpt"
)
FLAGS = [
    "--global-batch-size",
    "512",
    "--micro-batch-size",
    "2",
    "--lr",
    "0.001",
    "--max-steps",
    "1000",
    "--checkpoint-claim",
    "ckpt",
]
MANIFESTS = sorted(DATA.glob("*.yaml"))


def load(name: str) -> dict:
    return yaml.safe_load((DATA / name).read_text())


def converted(name: str, contract: convert.Contract = CONTRACT) -> convert.Conversion:
    return convert.convert(load(name), contract)


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.stem for p in MANIFESTS])
def test_every_example_converts_to_a_valid_job(path: Path):
    result = convert.convert(yaml.safe_load(path.read_text()), CONTRACT)
    job = result.objects[0]
    errors = [p for p in validation.validate_object(job) if p.severity is validation.Severity.ERROR]
    assert errors == [], errors
    assert job["spec"]["template"]["spec"]["containers"][0]["name"] == "trainer"


def test_master_and_worker_replicas_become_the_node_count():
    job = converted("simple.yaml").objects[0]
    assert job["spec"]["nodes"] == {"min": 2, "max": 2, "replicas": 2}
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "python3",
        "/opt/pytorch-mnist/mnist.py",
        "--epochs=1",
    ]
    assert job["metadata"] == {"name": "pytorch-simple", "namespace": "kubeflow"}


def test_elastic_policy_gives_the_range_and_the_launcher_is_stripped():
    result = converted("elastic-imagenet.yaml")
    spec = result.objects[0]["spec"]
    assert spec["nodes"] == {"min": 1, "max": 4, "replicas": 2}
    assert spec["restartPolicy"] == {"maxRestarts": 100}
    assert spec["rendezvous"] == {"port": 29400, "joinTimeoutSeconds": 900, "lastCallTimeoutSeconds": 15}
    assert spec["template"]["spec"]["containers"][0]["command"] == [
        "python",
        "/workspace/examples/imagenet.py",
        "--arch=resnet18",
        "--epochs=20",
        "--batch-size=32",
        "--workers=0",
        "/workspace/data/tiny-imagenet-200",
    ]
    assert any("is_host=false" in note for note in result.notes)


def test_a_module_launch_keeps_the_module():
    container = converted("elastic-echo.yaml").objects[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "elastic.echo"]
    assert container["env"] == [{"name": "LOGLEVEL", "value": "DEBUG"}]


def test_hpa_metrics_become_an_hpa_on_the_scale_subresource():
    job, hpa = converted("elastic-hpa.yaml").objects
    assert hpa["kind"] == "HorizontalPodAutoscaler" and hpa["metadata"] == {
        "name": "elastic-example-cpu",
        "namespace": "ml",
    }
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "name": "elastic-example-cpu",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert job["spec"]["nprocPerNode"] == 1  # from the launcher's --nproc_per_node
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "python",
        "/workspace/examples/imagenet.py",
        "--arch=resnet18",
    ]


def test_gpu_job_keeps_sidecar_volumes_and_policies():
    result = converted(
        "gpu-fsdp.yaml",
        convert.Contract(
            global_batch_size=512,
            micro_batch_size=2,
            lr=2e-5,
            max_samples=10_000_000,
            checkpoint_volume="shared",
            checkpoint_path="/mnt/shared/ckpt",
        ),
    )
    job = result.objects[0]
    spec = job["spec"]
    containers = spec["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["trainer", "log-shipper"]
    assert containers[0]["command"] == ["python", "finetune.py", "--config", "configs/7b.yaml"]
    assert containers[0]["env"] == [{"name": "NCCL_DEBUG", "value": "WARN"}]
    assert spec["nprocPerNode"] == 8 and spec["nodes"] == {"min": 4, "max": 4, "replicas": 4}
    assert spec["checkpoint"] == {"volumeName": "shared", "path": "/mnt/shared/ckpt"}
    assert spec["runPolicy"] == {
        "cleanPodPolicy": "None",
        "ttlSecondsAfterFinished": 3600,
        "activeDeadlineSeconds": 86400,
        "priorityClassName": "high-priority",
    }
    assert spec["restartPolicy"] == {"maxRestarts": 5}
    assert "restartPolicy" not in spec["template"]["spec"]
    assert job["metadata"]["annotations"] == {"owner": "alice"} and job["metadata"]["labels"] == {"team": "a"}
    notes = "\n".join(result.notes)
    for dropped in ("--max-restarts=3", "PET_NPROC_PER_NODE", "queue (team-a-gpu)", "ExitCode"):
        assert dropped in notes or "template.spec.restartPolicy" in notes, (dropped, notes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda j: j.update(kind="TFJob"), "kind: expected PyTorchJob, got 'TFJob'"),
        (lambda j: j.update(apiVersion="kubeflow.org/v2"), "apiVersion: expected kubeflow.org/v1"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief={"replicas": 1}), "Chief: only Master and Worker"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("command"),
            "no command",
        ),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(
                command=["torchrun", "--nnodes=2"]
            ),
            "no training script",
        ),
    ],
)
def test_unconvertible_input_names_the_field(change, message):
    job = load("elastic-echo.yaml")
    change(job)
    with pytest.raises(convert.ConversionError, match=message):
        convert.convert(job, CONTRACT)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disttrain.operator.cli", "convert", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )


def test_cli_without_the_contract_lists_what_to_fill_in():
    done = run_cli(str(DATA / "simple.yaml"))
    assert done.returncode == 2 and done.stdout == ""
    for flag in ("--global-batch-size", "--micro-batch-size", "--lr", "--max-steps", "--checkpoint-claim"):
        assert flag in done.stderr


def test_cli_output_passes_disttrain_validate(tmp_path: Path):
    done = run_cli(str(DATA / "gpu-fsdp.yaml"), *FLAGS)
    assert done.returncode == 0, done.stderr
    assert "note: container 'pytorch' renamed to 'trainer'" in done.stderr
    out = tmp_path / "job.yaml"
    out.write_text(done.stdout)
    check = subprocess.run(
        [sys.executable, "-m", "disttrain.operator.cli", "validate", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert check.returncode == 0, check.stdout + check.stderr
