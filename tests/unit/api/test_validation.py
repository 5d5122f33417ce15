"""`disttrain validate`: malformed manifests are refused with the field named; the examples pass."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from tests.conftest import REPO_ROOT, JobBuilder

from disttrain.api import validation


def container(**extra):
    return {"name": "trainer", "image": "example/trainer:1", "command": ["python", "train.py"], **extra}


# (id, builder, field path that must be named, text the message must contain)
MALFORMED = [
    ("replicas-not-int", lambda b: b.set("spec.nodes.replicas", "three"), "spec.nodes.replicas", "integer"),
    ("min-zero", lambda b: b.set("spec.nodes.min", 0), "spec.nodes.min", "greater than or equal to 1"),
    ("min-greater-than-max", lambda b: b.nodes(5, 4, 4), "spec.nodes.min", "must be <= nodes.max"),
    ("replicas-above-max", lambda b: b.nodes(1, 4, 6), "spec.nodes.replicas", "within [1, 4], got 6"),
    ("replicas-below-min", lambda b: b.nodes(3, 4, 2), "spec.nodes.replicas", "within [3, 4], got 2"),
    ("missing-nodes", lambda b: b.delete("spec.nodes"), "spec.nodes", "required"),
    (
        "silence-under-two-beats",
        lambda b: b.set("spec.rendezvous", {"silentAfterSeconds": 0.25}),
        "spec.rendezvous.silentAfterSeconds",
        "greater than or equal to 0.5",
    ),
    (
        "silence-beyond-torch-expiry",
        lambda b: b.set(
            "spec.rendezvous", {"keepAliveIntervalSeconds": 1, "keepAliveMaxAttempts": 3, "silentAfterSeconds": 4}
        ),
        "spec.rendezvous.silentAfterSeconds",
        "<= keepAliveIntervalSeconds x keepAliveMaxAttempts = 3, torch's expiry",
    ),
    ("missing-replicas", lambda b: b.delete("spec.nodes.replicas"), "spec.nodes.replicas", "required"),
    ("missing-training", lambda b: b.delete("spec.training"), "spec.training", "required"),
    ("missing-template", lambda b: b.delete("spec.template"), "spec.template", "required"),
    (
        "global-batch-not-divisible",
        lambda b: b.nodes(1, 4, 3).set("spec.training.globalBatchSize", 20),
        "spec.training.globalBatchSize",
        "not a multiple of microBatchSize*replicas*dataRanksPerNode = 2*3*1 = 6",
    ),
    (
        "global-batch-not-divisible-by-the-data-degree",
        lambda b: (
            b.nodes(3, 3, 3)
            .set("spec.nprocPerNode", 4)
            .set("spec.training.mesh", {"tensorParallel": 2})
            .set("spec.training.globalBatchSize", 18)
        ),
        "spec.training.globalBatchSize",
        "not a multiple of microBatchSize*replicas*dataRanksPerNode = 2*3*2 = 12",
    ),
    (
        "no-valid-node-count",
        lambda b: b.nodes(3, 3, 3).set("spec.training.globalBatchSize", 7).set("spec.training.microBatchSize", 7),
        "spec.training.globalBatchSize",
        "not a multiple",
    ),
    (
        "mesh-degree-not-dividing-nproc",
        lambda b: b.set("spec.nprocPerNode", 4).set("spec.training.mesh", {"tensorParallel": 3}),
        "spec.training.mesh",
        "training.mesh.tensorParallel = 3 must divide nprocPerNode = 4",
    ),
    (
        "mesh-shard-and-tensor-parallel",
        lambda b: b.set("spec.training.mesh", {"shard": 2, "tensorParallel": 2}),
        "spec.training.mesh",
        "exactly one of mesh.shard and mesh.tensorParallel must be set",
    ),
    (
        "unknown-batch-policy",
        lambda b: b.set("spec.training.batchPolicy", "elastic"),
        "spec.training.batchPolicy",
        "'fixed' or 'scaled'",
    ),
    (
        "unknown-lr-scaling",
        lambda b: b.set("spec.training.lr.scaling", "cubic"),
        "spec.training.lr.scaling",
        "'linear', 'sqrt' or 'none'",
    ),
    ("negative-lr", lambda b: b.set("spec.training.lr.base", -0.1), "spec.training.lr.base", "greater than 0"),
    (
        "negative-ramp",
        lambda b: b.set("spec.training.lr.rampSteps", -5),
        "spec.training.lr.rampSteps",
        "greater than or equal to 0",
    ),
    (
        "max-steps-and-samples",
        lambda b: b.set("spec.training.maxSamples", 1000),
        "spec.training",
        "exactly one of training.maxSteps and training.maxSamples",
    ),
    ("no-length", lambda b: b.delete("spec.training.maxSteps"), "spec.training", "exactly one"),
    (
        "negative-join-timeout",
        lambda b: b.set("spec.rendezvous.joinTimeoutSeconds", -1),
        "spec.rendezvous.joinTimeoutSeconds",
        "greater than or equal to 1",
    ),
    (
        "port-out-of-range",
        lambda b: b.set("spec.rendezvous.port", 70000),
        "spec.rendezvous.port",
        "less than or equal to 65535",
    ),
    (
        "negative-drain-timeout",
        lambda b: b.set("spec.elastic.drainTimeoutSeconds", -3),
        "spec.elastic.drainTimeoutSeconds",
        "greater than or equal to 1",
    ),
    (
        "unknown-clean-pod-policy",
        lambda b: b.set("spec.runPolicy.cleanPodPolicy", "Some"),
        "spec.runPolicy.cleanPodPolicy",
        "'All', 'Running' or 'None'",
    ),
    (
        "unknown-success-policy",
        lambda b: b.set("spec.successPolicy", "AnyWorker"),
        "spec.successPolicy",
        "'AllWorkers' or 'RankZero'",
    ),
    ("unknown-spec-field", lambda b: b.set("spec.foo", 1), "spec.foo", "unknown field"),
    ("typo-in-lr", lambda b: b.set("spec.training.lr.bogus", 1), "spec.training.lr.bogus", "unknown field"),
    (
        "both-claim-and-volume",
        lambda b: b.set("spec.checkpoint.volumeName", "data"),
        "spec.checkpoint",
        "exactly one of checkpoint.claimName, checkpoint.volumeName and checkpoint.uri",
    ),
    (
        "both-claim-and-uri",
        lambda b: b.set("spec.checkpoint.uri", "s3://bucket/jobs"),
        "spec.checkpoint",
        "exactly one of checkpoint.claimName, checkpoint.volumeName and checkpoint.uri",
    ),
    (
        "uri-of-another-scheme",
        lambda b: b.delete("spec.checkpoint.claimName").set("spec.checkpoint.uri", "gs://bucket/jobs"),
        "spec.checkpoint.uri",
        "the scheme gs:// is not supported; only s3://BUCKET/PREFIX",
    ),
    (
        "uri-with-a-bad-bucket-name",
        lambda b: b.delete("spec.checkpoint.claimName").set("spec.checkpoint.uri", "s3://My_Bucket/jobs"),
        "spec.checkpoint.uri",
        "the bucket 'My_Bucket' is not an S3 bucket name",
    ),
    (
        "uri-with-a-dot-dot-segment",
        lambda b: b.delete("spec.checkpoint.claimName").set("spec.checkpoint.uri", "s3://bucket/jobs/../x"),
        "spec.checkpoint.uri",
        "the prefix has an empty, '.' or '..' segment",
    ),
    (
        "uri-without-scheme",
        lambda b: b.delete("spec.checkpoint.claimName").set("spec.checkpoint.uri", "bucket/jobs"),
        "spec.checkpoint.uri",
        "is not an s3://BUCKET/PREFIX URI",
    ),
    (
        "s3-options-without-uri",
        lambda b: b.set("spec.checkpoint.s3", {"region": "eu-west-1"}),
        "spec.checkpoint.s3",
        "applies only to a checkpoint.uri",
    ),
    (
        "local-tier-limit-without-uri",
        lambda b: b.set("spec.checkpoint.localTierSizeLimit", "10Gi"),
        "spec.checkpoint.localTierSizeLimit",
        "applies only to a checkpoint.uri",
    ),
    (
        "local-tier-limit-not-a-quantity",
        lambda b: (
            b.delete("spec.checkpoint.claimName")
            .set("spec.checkpoint.uri", "s3://bucket/jobs")
            .set("spec.checkpoint.localTierSizeLimit", "ten gigs")
        ),
        "spec.checkpoint.localTierSizeLimit",
        "should match pattern",
    ),
    (
        "s3-endpoint-not-a-url",
        lambda b: (
            b.delete("spec.checkpoint.claimName")
            .set("spec.checkpoint.uri", "s3://bucket/jobs")
            .set("spec.checkpoint.s3", {"endpoint": "minio:9000"})
        ),
        "spec.checkpoint.s3.endpoint",
        "should match pattern",
    ),
    (
        "s3-unknown-addressing-style",
        lambda b: (
            b.delete("spec.checkpoint.claimName")
            .set("spec.checkpoint.uri", "s3://bucket/jobs")
            .set("spec.checkpoint.s3", {"addressingStyle": "host"})
        ),
        "spec.checkpoint.s3.addressingStyle",
        "'auto', 'path' or 'virtual'",
    ),
    (
        "s3-credentials-secret-not-a-name",
        lambda b: (
            b.delete("spec.checkpoint.claimName")
            .set("spec.checkpoint.uri", "s3://bucket/jobs")
            .set("spec.checkpoint.s3", {"credentialsSecret": "My Secret"})
        ),
        "spec.checkpoint.s3.credentialsSecret",
        "should match pattern",
    ),
    ("no-checkpoint-storage", lambda b: b.delete("spec.checkpoint.claimName"), "spec.checkpoint", "exactly one"),
    (
        "checkpoint-volume-not-declared",
        lambda b: b.delete("spec.checkpoint.claimName").set("spec.checkpoint.volumeName", "ckpt"),
        "spec.checkpoint.volumeName",
        "not a volume of template.spec.volumes",
    ),
    (
        "relative-checkpoint-path",
        lambda b: b.set("spec.checkpoint.path", "ckpt"),
        "spec.checkpoint.path",
        "should match pattern",
    ),
    ("keep-zero", lambda b: b.set("spec.checkpoint.keep", 0), "spec.checkpoint.keep", "greater than or equal to 1"),
    (
        "interval-steps-zero",
        lambda b: b.set("spec.checkpoint.intervalSteps", 0),
        "spec.checkpoint.intervalSteps",
        "intervalSteps must be an integer >= 1 or 'auto', got 0",
    ),
    (
        "interval-steps-bad-word",
        lambda b: b.set("spec.checkpoint.intervalSteps", "often"),
        "spec.checkpoint.intervalSteps",
        "intervalSteps must be an integer >= 1 or 'auto', got 'often'",
    ),
    (
        "interval-steps-numeric-string",
        lambda b: b.set("spec.checkpoint.intervalSteps", "50"),
        "spec.checkpoint.intervalSteps",
        "got '50'",
    ),
    (
        "replacement-wait-bad-word",
        lambda b: b.set("spec.elastic.replacementWaitSeconds", "soon"),
        "spec.elastic.replacementWaitSeconds",
        "replacementWaitSeconds must be an integer from 0 to 86400 or 'auto', got 'soon'",
    ),
    (
        "replacement-wait-negative",
        lambda b: b.set("spec.elastic.replacementWaitSeconds", -1),
        "spec.elastic.replacementWaitSeconds",
        "got -1",
    ),
    (
        "two-containers-none-named-trainer",
        lambda b: b.set("spec.template.spec.containers", [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]),
        "spec.template.spec",
        "container named 'trainer'",
    ),
    (
        "trainer-without-command",
        lambda b: b.set("spec.template.spec.containers", [{"name": "trainer", "image": "x", "args": ["train.py"]}]),
        "spec.template.spec.containers",
        "the trainer container needs a command",
    ),
    (
        "container-without-name",
        lambda b: b.set("spec.template.spec.containers", [{"image": "x", "command": ["t"]}]),
        "spec.template.spec.containers[0]",
        "'name' is a required property",
    ),
    (
        "template-typo",
        lambda b: b.set("spec.template.spec.nodeSelectr", {"a": "b"}),
        "spec.template.spec.nodeSelectr",
        "unknown field",
    ),
    (
        "template-wrong-type",
        lambda b: b.set("spec.template.spec.containers", [container(args="--x")]),
        "spec.template.spec.containers[0].args",
        "is not of type 'array'",
    ),
    (
        "reserved-env",
        lambda b: b.set(
            "spec.template.spec.containers", [container(env=[{"name": "DISTTRAIN_CONTRACT", "value": "{}"}])]
        ),
        "spec.template.spec.containers[0].env",
        "reserved",
    ),
    (
        "backoff-above-max",
        lambda b: b.set("spec.restartPolicy", {"backoffSeconds": 60, "maxBackoffSeconds": 10}),
        "spec.restartPolicy.backoffSeconds",
        "must be <=",
    ),
    (
        "exit-code-in-both-classes",
        lambda b: b.set("spec.restartPolicy", {"exitCodes": {"permanent": [85, 3], "retryable": [3]}}),
        "spec.restartPolicy.exitCodes.retryable",
        "both permanent",
    ),
    ("name-too-long", lambda b: b.set("metadata.name", "a" * 50), "metadata.name", "at most 45 characters"),
    ("name-not-dns", lambda b: b.set("metadata.name", "My_Job"), "metadata.name", "should match pattern"),
    ("name-with-dots", lambda b: b.set("metadata.name", "my.job"), "metadata.name", "should match pattern"),
    ("wrong-kind", lambda b: b.set("kind", "PyTorchJob"), "apiVersion/kind", "expected disttrain.dev/v1alpha1"),
    ("nproc-zero", lambda b: b.set("spec.nprocPerNode", 0), "spec.nprocPerNode", "greater than or equal to 1"),
    (
        "negative-ttl",
        lambda b: b.set("spec.runPolicy.ttlSecondsAfterFinished", -1),
        "spec.runPolicy.ttlSecondsAfterFinished",
        "greater than or equal to 0",
    ),
    ("suspend-not-bool", lambda b: b.set("spec.runPolicy.suspend", "maybe"), "spec.runPolicy.suspend", "boolean"),
    (
        "template-runs-as-another-jobs-agent",
        lambda b: b.set("spec.template.spec.serviceAccountName", "other-agent"),
        "spec.template.spec.serviceAccountName",
        "serviceAccountName other-agent is not allowed: names ending in '-agent' are reserved",
    ),
    (
        "template-runs-as-an-agent-by-the-deprecated-alias",
        lambda b: b.set("spec.template.spec.serviceAccount", "train-agent"),
        "spec.template.spec.serviceAccount",
        "serviceAccount train-agent is not allowed",
    ),
]


@pytest.mark.parametrize(("build", "path", "text"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_manifest_is_refused_naming_the_field(build, path, text):
    problems = validation.validate_object(build(JobBuilder()).build())
    errors = [p for p in problems if p.severity is validation.Severity.ERROR]
    assert any(p.path == path and text in p.message for p in errors), "\n".join(map(str, problems))


def test_the_base_manifest_of_the_matrix_is_valid():
    assert validation.validate_object(JobBuilder().build()) == []


def test_a_checkpoint_in_a_bucket_with_its_s3_options_is_valid():
    s3 = {"endpoint": "http://rgw.storage:8080", "region": "us-east-1", "addressingStyle": "path"}
    obj = (
        JobBuilder()
        .delete("spec.checkpoint.claimName")
        .set("spec.checkpoint.uri", "s3://ckpt-bucket/teams/nlp/")
        .set("spec.checkpoint.s3", {**s3, "credentialsSecret": "s3-creds"})
        .set("spec.checkpoint.localTierSizeLimit", "200Gi")
        .build()
    )
    assert validation.validate_object(obj) == []


def fixed_batch_under_tensor_parallel() -> JobBuilder:
    """3 nodes of 4 ranks in pairs of tensorParallel 2: a data degree of 6, so a global batch of 12 is 2 samples per
    data rank. The world size (12 ranks) does not divide it, and need not: both ranks of a pair read the same."""
    return (
        JobBuilder()
        .nodes(3, 3, 3)
        .set("spec.nprocPerNode", 4)
        .set("spec.training.mesh", {"tensorParallel": 2})
        .set("spec.training.globalBatchSize", 12)
    )


def test_a_fixed_batch_the_data_degree_divides_is_admitted_under_tensor_parallel():
    assert validation.validate_object(fixed_batch_under_tensor_parallel().build()) == []


def test_every_problem_is_reported_in_one_pass():
    obj = JobBuilder().set("spec.nodes.min", 0).set("spec.training.lr.scaling", "cubic").set("spec.foo", 1).build()
    paths = {p.path for p in validation.validate_object(obj)}
    assert {"spec.nodes.min", "spec.training.lr.scaling", "spec.foo"} <= paths


def test_node_counts_that_cannot_divide_the_batch_are_a_warning_listing_the_valid_ones():
    obj = JobBuilder().nodes(1, 5, 4).build()  # 24 / (2*5) is not whole
    [problem] = validation.validate_object(obj)
    assert problem.severity is validation.Severity.WARNING
    assert "node counts 5 cannot divide" in problem.message and "1, 2, 3, 4" in problem.message


EXAMPLES = sorted((REPO_ROOT / "examples" / "jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_manifest_is_valid(path: pathlib.Path):
    job = validation.load_job(path)
    assert job.metadata.name


def test_cli_validate_exits_non_zero_and_prints_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    import yaml

    bad.write_text(yaml.safe_dump(JobBuilder().nodes(1, 4, 6).build()))
    run = subprocess.run(
        [sys.executable, "-m", "disttrain.operator.cli", "validate", str(bad), *map(str, EXAMPLES)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 1
    assert f"{bad}: spec.nodes.replicas: nodes.replicas must be within [1, 4], got 6" in run.stderr
    for example in EXAMPLES:
        assert f"{example}: valid" in run.stdout


def test_cli_validate_reports_yaml_syntax_errors_without_a_traceback(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("spec: [unclosed\n")
    run = subprocess.run(
        [sys.executable, "-m", "disttrain.operator.cli", "validate", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 1 and "<yaml>" in run.stderr and "Traceback" not in run.stderr


def test_load_job_raises_with_every_error():
    with pytest.raises(validation.ManifestError) as caught:
        validation.load_job(pathlib.Path("/nonexistent/job.yaml"))
    assert "<file>" in str(caught.value)


def test_an_nproc_per_node_that_differs_from_the_gpu_limit_is_a_warning_naming_both():
    obj = JobBuilder().set("spec.nprocPerNode", 2).build()
    obj["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    obj["spec"]["training"]["globalBatchSize"] = 48
    [problem] = validation.validate_object(obj)
    assert problem.severity is validation.Severity.WARNING and problem.path == "spec.nprocPerNode"
    assert "nprocPerNode 2 differs" in problem.message and "set nprocPerNode: 4" in problem.message


def test_an_nproc_per_node_equal_to_the_gpu_limit_is_fine():
    obj = JobBuilder().set("spec.nprocPerNode", 4).build()
    obj["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    obj["spec"]["training"]["globalBatchSize"] = 96
    assert validation.validate_object(obj) == []


def test_an_elastic_range_under_kueue_is_a_warning_saying_how_to_resize():
    obj = JobBuilder().nodes(1, 4, 2).set("metadata.labels", {"kueue.x-k8s.io/queue-name": "team-a"}).build()
    [problem] = validation.validate_object(obj)
    assert problem.severity is validation.Severity.WARNING and problem.path == "spec.nodes"
    assert "fixed size" in problem.message and "suspend" in problem.message
    fixed = JobBuilder().nodes(2, 2, 2).set("metadata.labels", {"kueue.x-k8s.io/queue-name": "team-a"}).build()
    assert validation.validate_object(fixed) == []


@pytest.mark.parametrize(
    "gang, path",
    [
        ({"scheduler": "scheduler-plugins", "queue": "q"}, "spec.gang.queue"),
        ({"scheduler": "volcano", "scheduleTimeoutSeconds": 60}, "spec.gang.scheduleTimeoutSeconds"),
    ],
    ids=["queue-on-coscheduling", "timeout-on-volcano"],
)
def test_a_gang_setting_the_chosen_scheduler_ignores_is_a_warning(gang, path):
    [problem] = validation.validate_object(JobBuilder().set("spec.gang", gang).build())
    assert problem.severity is validation.Severity.WARNING and problem.path == path


def test_an_unknown_gang_scheduler_is_an_error_naming_the_field():
    problems = validation.validate_object(JobBuilder().set("spec.gang", {"scheduler": "yunikorn"}).build())
    assert [p.path for p in problems if p.severity is validation.Severity.ERROR] == ["spec.gang.scheduler"]
