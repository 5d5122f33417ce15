"""The agent pod's own placement (``spec.agent``) and the worker pods' grace period (``operator.graceperiod``)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from pydantic import ValidationError
from tests.unit.operator.world import job_manifest

from disttrain.api import validation
from disttrain.api.spec import DistTrainJob
from disttrain.operator import graceperiod, pods

pytestmark = pytest.mark.timeout(60)
K8S_VERSION = "1.33.0"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
        }
    }
}
CPU_POOL_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]}]
        }
    }
}


AVOID_WORKERS = {
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {"matchLabels": {"disttrain.dev/job-name": "demo", "disttrain.dev/role": "worker"}},
                "topologyKey": "kubernetes.io/hostname",
            },
        }
    ]
}
"""The agent's default: prefer a node that runs none of this job's workers."""


def gpu_manifest(**spec):
    """A job whose template asks for GPU nodes: selector, taint toleration, affinity, a root securityContext."""
    manifest = job_manifest(**spec)
    template = manifest["spec"]["template"]["spec"]
    template["nodeSelector"] = {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    template["tolerations"] = [GPU_TAINT]
    template["affinity"] = GPU_AFFINITY
    template["securityContext"] = {"runAsUser": 0, "runAsNonRoot": False}
    template["imagePullSecrets"] = [{"name": "mirror"}]
    template["priorityClassName"] = "training"
    template["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    return manifest


def agent_spec(manifest):
    pod = pods.build_agent_pod(DistTrainJob.model_validate(manifest))
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    return pod["spec"]


def test_the_agent_takes_none_of_a_gpu_templates_placement_by_default():
    spec = agent_spec(gpu_manifest())
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        assert key not in spec, key
    assert spec["affinity"] == {"podAntiAffinity": AVOID_WORKERS}, "only the preference for nodes without workers"
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["imagePullSecrets"] == [{"name": "mirror"}], "the registry mirror's secret serves its image too"
    [container] = spec["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "250m", "memory": "512Mi"},
        "limits": {"memory": pods.AGENT_MEMORY},
    }
    assert "nvidia.com/gpu" not in str(spec)


def test_the_agent_takes_spec_agent_placement_and_only_it():
    placement = {
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}],
        "affinity": CPU_POOL_AFFINITY,
        "priorityClassName": "job-agents",
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi", "cpu": 1}},
    }
    spec = agent_spec(gpu_manifest(agent=placement))
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"] == placement["tolerations"]
    assert spec["affinity"] == {**CPU_POOL_AFFINITY, "podAntiAffinity": AVOID_WORKERS}
    assert spec["priorityClassName"] == "job-agents"
    assert spec["containers"][0]["resources"] == placement["resources"]


def test_the_agent_avoids_its_workers_nodes_unless_told_otherwise():
    own = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }
    assert agent_spec(job_manifest(agent={"affinity": own}))["affinity"] == own, "the user's anti-affinity wins"
    assert "affinity" not in agent_spec(job_manifest(agent={"avoidWorkers": False}))
    workers = pods.build_worker_pod(DistTrainJob.model_validate(job_manifest()), 0)
    selector = AVOID_WORKERS["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["labelSelector"]
    assert selector["matchLabels"].items() <= workers["metadata"]["labels"].items(), "the term selects the workers"


def test_a_resources_map_given_replaces_its_default_and_the_other_keeps_its_own():
    spec = agent_spec(job_manifest(agent={"resources": {"requests": {"cpu": "1"}}}))
    assert spec["containers"][0]["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": pods.AGENT_MEMORY}}
    spec = agent_spec(job_manifest(agent={"resources": {"limits": {}}}))
    assert spec["containers"][0]["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"}}


def test_the_workers_keep_the_templates_placement():
    manifest = gpu_manifest(agent={"nodeSelector": {"pool": "cpu"}, "priorityClassName": "job-agents"})
    worker = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)["spec"]
    assert worker["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert worker["tolerations"] == [GPU_TAINT] and worker["affinity"] == GPU_AFFINITY
    assert worker["priorityClassName"] == "training"


@pytest.mark.parametrize(
    ("agent", "path"),
    [
        ({"resources": {"requests": {"cpu": "lots"}}}, "spec.agent.resources.requests.cpu"),
        ({"resources": {"limits": {"memory": "-1Gi"}}}, "spec.agent.resources.limits.memory"),
        ({"tolerations": [{"key": "a", "operator": "In"}]}, "spec.agent.tolerations[0].operator"),
        ({"tolerations": [{"key": "a", "effect": "Sometimes"}]}, "spec.agent.tolerations[0].effect"),
        ({"nodeSelector": {"pool": 3}}, "spec.agent.nodeSelector.pool"),
        ({"priorityClassName": ""}, "spec.agent.priorityClassName"),
        ({"hostNetwork": True}, "spec.agent.hostNetwork"),
    ],
    ids=[
        "bad-quantity",
        "negative-quantity",
        "bad-operator",
        "bad-effect",
        "selector-not-string",
        "empty-class",
        "unknown",
    ],
)
def test_a_bad_agent_placement_is_refused_and_named(agent, path):
    with pytest.raises(ValidationError):
        DistTrainJob.model_validate(job_manifest(agent=agent))
    problems = validation.validate_object(job_manifest(agent=agent))
    assert [p.path for p in problems] == [path], problems


@pytest.mark.parametrize(
    ("affinity", "path"),
    [
        ({"nodeAffinity": {"bogus": 1}}, "spec.agent.affinity.nodeAffinity.bogus"),
        (
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": 3}}},
            "spec.agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
        ),
    ],
    ids=["unknown-field", "wrong-type"],
)
def test_validate_checks_the_agents_affinity_as_the_api_server_does(affinity, path):
    problems = validation.validate_object(job_manifest(agent={"affinity": affinity}))
    assert [p.path for p in problems] == [path], problems
    assert validation.validate_object(job_manifest(agent={"affinity": CPU_POOL_AFFINITY})) == []


def test_the_crd_gives_the_agents_affinity_the_kubernetes_schema():
    from disttrain.api import crd

    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    agent = spec["properties"]["agent"]["properties"]
    pod_spec = crd.pod_template_schema()["properties"]["spec"]["properties"]
    assert {k: v for k, v in agent["affinity"].items() if k != "description"} == pod_spec["affinity"]
    assert agent["resources"]["properties"]["requests"]["default"] == {"cpu": "250m", "memory": "512Mi"}


def interval(step_seconds, save_seconds):
    return {"checkpointInterval": {"steps": 10, "saveSeconds": save_seconds, "stepSeconds": step_seconds}}


def grace(status=None, **spec):
    return graceperiod.worker_grace_seconds(DistTrainJob.model_validate(job_manifest(**spec)).spec, status)


@pytest.mark.parametrize(
    ("spec", "status", "expected"),
    [
        ({}, None, 120),
        ({"elastic__drainTimeoutSeconds": 45}, None, 45),
        ({}, interval(2.0, 20.0), 120),
        ({}, interval(10.0, 80.4), 181),
        ({"checkpoint__async": True}, interval(10.0, 80.4), 120),
        ({}, interval(1e12, 1.0), graceperiod.MAX_SECONDS),
        ({}, {"checkpointInterval": {"stepSeconds": 100.0}}, 120),
        ({}, {"checkpointInterval": {"stepSeconds": float("nan"), "saveSeconds": 100.0}}, 120),
        ({}, {"checkpointInterval": "soon"}, 120),
        ({"checkpoint__terminationGracePeriodSeconds": 30}, interval(10.0, 80.4), 30),
        ({"checkpoint__terminationGracePeriodSeconds": 900}, None, 900),
    ],
    ids=[
        "default-drain-timeout",
        "drain-timeout-is-the-floor",
        "short-measured-save-keeps-the-floor",
        "long-measured-save-twice-step-plus-save",
        "async-save-is-not-measured",
        "derived-is-capped",
        "half-a-measurement-is-none",
        "nan-is-no-measurement",
        "malformed-status",
        "spec-field-wins-over-measurement",
        "spec-field-wins-over-floor",
    ],
)
def test_the_grace_period_rule(spec, status, expected):
    assert grace(status, **spec) == expected


def test_the_worker_pod_takes_the_rule_unless_the_template_sets_its_own():
    manifest = job_manifest(checkpoint__terminationGracePeriodSeconds=600)
    pod = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    job = DistTrainJob.model_validate({**job_manifest(), "status": interval(30.0, 90.0)})
    assert pods.build_worker_pod(job, 0)["spec"]["terminationGracePeriodSeconds"] == 240
    manifest["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    pod = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5


def test_the_agent_pod_keeps_kubernetes_default_grace_period():
    assert (
        "terminationGracePeriodSeconds" not in pods.build_agent_pod(DistTrainJob.model_validate(job_manifest()))["spec"]
    )
