"""What ``helm template`` renders: the expected objects, each valid for Kubernetes 1.33 (strict), and a
Deployment whose arguments the ``disttrain operator`` CLI accepts and whose ports the Service targets."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import kubernetes_validate
import pytest
from tests.chart.dashboard import DASHBOARD
from tests.chart.helm import NAMESPACE, NON_DEFAULT_VALUES, by_kind, render
from tests.unit.operator.world import job_manifest

from disttrain.api import pulse
from disttrain.api.spec import DistTrainJob
from disttrain.operator import cli, pods

CASES = {"default": None, "non-default": NON_DEFAULT_VALUES}
PROMETHEUS_OPERATOR_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")


@pytest.fixture(scope="module", params=list(CASES))
def rendered(request) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = CASES[request.param] or {}
    return values, render(CASES[request.param])


def _operator_args(objects: list[dict[str, Any]]):
    [deployment] = by_kind(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["disttrain", "operator"]  # any image: the entrypoint is not relied on
    return container, cli.build_parser().parse_args([*container["command"][1:], *container["args"]])


def test_default_objects():
    kinds = sorted(obj["kind"] for obj in render())
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "FlowSchema",
        "FlowSchema",
        "NetworkPolicy",
        "PriorityLevelConfiguration",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]


def test_the_operator_mounts_its_pulse_key_from_the_charts_secret(rendered):
    """Each job's pulse key is derived from it: one key for every replica and every restart of the operator."""
    _, objects = rendered
    [secret] = by_kind(objects, "Secret")
    key = pulse.parse_key(base64.b64decode(secret["data"][pulse.SECRET_KEY]).decode())
    assert len(key) == pulse.KEY_BYTES
    container, args = _operator_args(objects)
    [deployment] = by_kind(objects, "Deployment")
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] and args.agent_pulse_key_file == f"{mount['mountPath']}/{pulse.SECRET_KEY}"


def test_a_pulse_key_secret_of_ones_own_is_mounted_and_none_is_made():
    """For charts rendered without a cluster (helm template, Argo CD), where every render would make a new key."""
    objects = render({"agent": {"pulseKeySecret": "my-pulse-key"}})
    assert not by_kind(objects, "Secret")
    [deployment] = by_kind(objects, "Deployment")
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == "my-pulse-key"


def _operator_flow_schema(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [schema] = [obj for obj in by_kind(objects, "FlowSchema") if not obj["metadata"]["name"].endswith("-progress")]
    return schema


def test_the_operators_requests_get_a_priority_level_apart_from_the_job_agents(rendered):
    values, objects = rendered
    schema = _operator_flow_schema(objects)
    [account] = by_kind(objects, "ServiceAccount")
    wanted = values.get("flowControl", {})
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == wanted.get("priorityLevel", "workload-high")
    assert schema["spec"]["matchingPrecedence"] == wanted.get("matchingPrecedence", 1000) < 9000  # service-accounts
    [rule] = schema["spec"]["rules"]
    assert rule["subjects"] == [
        {
            "kind": "ServiceAccount",
            "serviceAccount": {"name": account["metadata"]["name"], "namespace": account["metadata"]["namespace"]},
        }
    ]
    disabled = render({"flowControl": {"enabled": False}})
    assert not by_kind(disabled, "FlowSchema") and not by_kind(disabled, "PriorityLevelConfiguration")


def test_the_agents_progress_writes_get_a_bounded_priority_level_of_their_own():
    objects = render()
    [level] = by_kind(objects, "PriorityLevelConfiguration")
    [schema] = [obj for obj in by_kind(objects, "FlowSchema") if obj is not _operator_flow_schema(objects)]
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"]
    limited = level["spec"]["limited"]
    assert level["spec"]["type"] == "Limited" and limited["nominalConcurrencyShares"] == 2
    assert limited["lendablePercent"] == limited["borrowingLimitPercent"] == 0  # bounded while others idle too
    assert limited["limitResponse"]["type"] == "Queue"  # queued fairly, not refused with 429
    # After the operator's schema (which takes all of the operator's requests), before "service-accounts" (9000).
    assert _operator_flow_schema(objects)["spec"]["matchingPrecedence"] < schema["spec"]["matchingPrecedence"] < 9000
    assert schema["spec"]["distinguisherMethod"] == {"type": "ByUser"}  # a flow per agent: each job gets its turn
    [rule] = schema["spec"]["rules"]
    assert rule["subjects"] == [{"kind": "Group", "group": {"name": "system:serviceaccounts"}}]
    assert rule["resourceRules"] == [
        {
            "verbs": ["patch", "update"],
            "apiGroups": ["disttrain.dev"],
            "resources": ["disttrainjobs/status"],
            "namespaces": ["*"],
        }
    ]
    assert "nonResourceRules" not in rule
    shares = render({"flowControl": {"progress": {"nominalConcurrencyShares": 7, "matchingPrecedence": 1500}}})
    [level] = by_kind(shares, "PriorityLevelConfiguration")
    assert level["spec"]["limited"]["nominalConcurrencyShares"] == 7
    assert {obj["spec"]["matchingPrecedence"] for obj in by_kind(shares, "FlowSchema")} == {1000, 1500}
    off = render({"flowControl": {"progress": {"enabled": False}}})
    assert not by_kind(off, "PriorityLevelConfiguration") and len(by_kind(off, "FlowSchema")) == 1


def test_non_default_objects():
    objects = render(NON_DEFAULT_VALUES)
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "FlowSchema",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "PodMonitor",
            "PrometheusRule",
            "ConfigMap",
            "Secret",
            "Role",
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "RoleBinding",
        ]
    )
    assert {(obj["kind"], obj["metadata"]["namespace"]) for obj in objects if obj["kind"].startswith("Role")} == {
        (kind, ns) for kind in ("Role", "RoleBinding") for ns in [*NON_DEFAULT_VALUES["watchNamespaces"], NAMESPACE]
    }


def test_every_object_validates_against_kubernetes_1_33(rendered):
    _, objects = rendered
    for obj in objects:
        if obj["kind"] in PROMETHEUS_OPERATOR_KINDS:
            continue  # prometheus-operator's CRDs, not in Kubernetes' schema: tests of their own check them
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_namespaced_objects_are_in_the_release_namespace(rendered):
    _, objects = rendered
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Deployment", "Service", *PROMETHEUS_OPERATOR_KINDS):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]


def test_deployment_args_are_accepted_by_the_operator_cli(rendered):
    values, objects = rendered
    container, args = _operator_args(objects)
    watch = values.get("watchNamespaces", [])
    assert args.all_namespaces is (not watch)
    assert (args.namespace or []) == watch
    assert args.metrics_port == values.get("metrics", {}).get("port", 9090)
    assert args.liveness == f"http://0.0.0.0:{values.get('liveness', {}).get('port', 8080)}/healthz"
    assert args.log_level == values.get("logLevel", "info")
    network = values.get("networkPolicy", {})
    settings = cli.network_policy_settings(args)
    assert settings.enabled is network.get("enabled", True)
    scraper = network.get("metricsScraper", {})
    assert settings.scraper_namespace_selector == scraper.get("namespaceSelector", {})
    assert settings.scraper_pod_selector == scraper.get(
        "podSelector", {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    )
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": args.metrics_port, "healthz": int(args.liveness.split(":")[2].split("/")[0])}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_image(rendered):
    values, objects = rendered
    container, _ = _operator_args(objects)
    image = values.get("image", {})
    assert container["image"] == f"{image.get('repository', 'ghcr.io/disttrain/operator')}:{image.get('tag', '0.1.0')}"


def test_metrics_service_selects_the_operator_pod(rendered):
    _, objects = rendered
    [deployment] = by_kind(objects, "Deployment")
    [service] = by_kind(objects, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    _, args = _operator_args(objects)
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": args.metrics_port, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_deployment_uses_the_service_account():
    objects = render()
    [deployment] = by_kind(objects, "Deployment")
    [account] = by_kind(objects, "ServiceAccount")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_two_replicas_elect_a_leader_on_a_lease_only_they_may_update():
    objects = render()
    [deployment] = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    container, args = _operator_args(objects)
    [pod_name] = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert args.leader_election_identity == "$(POD_NAME)"  # the kubelet expands it from env
    assert args.leader_election_namespace == NAMESPACE
    assert cli.leader_election_options(args) is not None  # the chart's timings pass the operator's own check
    [role] = [r for r in by_kind(objects, "Role") if r["metadata"]["namespace"] == NAMESPACE]
    [binding] = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["namespace"] == NAMESPACE]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": deployment["spec"]["template"]["spec"]["serviceAccountName"],
            "namespace": NAMESPACE,
        }
    ]
    # create cannot be narrowed to a name; get and update only on the operator's own Lease
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [args.leader_election_lease],
            "verbs": ["get", "update"],
        },
    ]
    # the replicas prefer different nodes, unless affinity is given
    spread = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    custom = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    [single] = by_kind(render({"affinity": custom, "replicaCount": 1}), "Deployment")
    [custom_timing] = by_kind(render(NON_DEFAULT_VALUES), "Deployment")
    options = cli.leader_election_options(_operator_args([custom_timing])[1])
    assert options is not None and (
        options.timing.lease_s,
        options.timing.renew_deadline_s,
        options.timing.retry_s,
    ) == (15, 10, 2)
    assert single["spec"]["template"]["spec"]["affinity"] == custom and single["spec"]["replicas"] == 1


def test_service_monitor():
    """Off by default; when on, a ServiceMonitor (monitoring.coreos.com/v1) that selects the metrics Service."""
    assert not by_kind(render(), "ServiceMonitor")
    objects = render(NON_DEFAULT_VALUES)
    [monitor] = by_kind(objects, "ServiceMonitor")
    [service] = by_kind(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "15s", "scrapeTimeout": "5s"}
    ]


def _worker_pod(namespace: str, nproc: int) -> dict[str, Any]:
    manifest = job_manifest(nprocPerNode=nproc)
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8000}]
    return pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]], ids=["all-namespaces", "watch-namespaces"])
def test_pod_monitor_selects_every_local_ranks_exporter_of_the_worker_pods(watch):
    """Off by default. On: the worker pods the operator builds are selected, one target per ``metrics*`` port (what
    Prometheus' pod discovery makes of each declared port, then the keep rule), labelled job=<job name>."""
    assert not by_kind(render(), "PodMonitor")
    [monitor] = by_kind(render({"podMonitor": {"enabled": True}, "watchNamespaces": watch}), "PodMonitor")
    spec = monitor["spec"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert spec["namespaceSelector"] == ({"matchNames": watch} if watch else {"any": True})
    pod = _worker_pod("team-a", nproc=3)
    labels = pod["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert labels[spec["jobLabel"]] == "demo"  # the DistTrainJob's name, as in the operator's per-job series
    [endpoint] = spec["podMetricsEndpoints"]
    [keep] = endpoint["relabelings"]
    assert keep["action"] == "keep" and keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    kept = [
        port["containerPort"]
        for container in pod["spec"]["containers"]
        for port in container["ports"]
        if re.fullmatch(keep["regex"], port["name"])
    ]  # Prometheus anchors relabel regexes
    assert kept == [9400, 9401, 9402]
    agent = pods.build_agent_pod(DistTrainJob.model_validate(job_manifest()))
    assert not spec["selector"]["matchLabels"].items() <= agent["metadata"]["labels"].items()


def test_dashboard_config_map_carries_the_dashboard_for_grafanas_sidecar():
    assert not by_kind(render(), "ConfigMap")
    [default_on] = by_kind(render({"dashboards": {"enabled": True}}), "ConfigMap")
    assert default_on["metadata"]["namespace"] == NAMESPACE
    [config_map] = by_kind(render(NON_DEFAULT_VALUES), "ConfigMap")
    metadata = config_map["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["grafana_dashboard"] == "1" and metadata["labels"]["team"] == "ml"
    assert metadata["annotations"] == {"grafana_folder": "Training"}
    assert json.loads(config_map["data"]["disttrain.json"]) == json.loads(DASHBOARD.read_text())


def test_the_operator_pods_admit_only_the_metrics_scraper_and_the_liveness_probe():
    policies = [o for o in render() if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 1, policies
    spec = policies[0]["spec"]
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    assert spec["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress"]
    metrics, liveness = spec["ingress"]
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert metrics["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    assert liveness == {"ports": [{"protocol": "TCP", "port": 8080}]}
    assert not [o for o in render({"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize(
    ("agent_values", "heartbeat_s"),
    [
        ({}, 0.0),  # the default: the agents pulse, so no Lease and no API write per second per job
        ({"pulseSeconds": 0}, 1.0),  # no pulse: the Lease is how a lost agent is found before NotReady
        ({"heartbeatSeconds": 1}, 1.0),
        ({"heartbeatSeconds": 0, "pulseSeconds": 0}, 0.0),
    ],
)
def test_the_agents_renew_a_lease_only_without_a_pulse_unless_told(agent_values, heartbeat_s):
    _, args = _operator_args(render({"agent": agent_values}))
    assert cli.agent_heartbeat_seconds(args.agent_heartbeat_seconds, args.agent_pulse_seconds) == heartbeat_s
