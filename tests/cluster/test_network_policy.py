"""On the real control plane: every job's NetworkPolicies select exactly its pods, and an outsider in
another namespace costs a training job nothing.

The selectors are evaluated by the API server itself: each policy's pod selector, and each ingress rule's
namespace and pod selectors, are sent as ``labelSelector`` queries, and what comes back is compared with the pods
the job owns. A pod in another namespace that carries the job's labels (pod labels are no proof of anything) is
listed too: a policy's pod selector only applies in its own namespace, and a peer without a namespace selector only
admits pods of the policy's namespace.

The outsider test runs on the process-kubelet tier, which has no network plugin: NetworkPolicy is NOT enforced
there, so the outsider does reach the agent's store port. It shows that the store front holds where the policy is
not enforced (no byte of the outsider reaches torch's server), as the issue asks; the policy itself is only
checked as the API server stores it.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from disttrain.api import constants
from disttrain.operator import access
from tests.cluster.controlplane import ControlPlane
from tests.cluster.harness import Cluster, _try, checkpoint_claim, delete_jobs, eventually
from tests.cluster.kubelet import Kubelets
from tests.cluster.process_kubelet import ProcessKubelets
from tests.cluster.rbac import OPERATOR_NAMESPACE, chart_operator_pod_labels
from tests.conftest import JobBuilder
from tests.e2e.conftest import e2e_job

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(180)]

NETWORKING = "/apis/networking.k8s.io/v1"
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.fixture
def cluster(controllers, namespace, operator) -> Iterator[Cluster]:
    sim = Kubelets(controllers)
    checkpoint_claim(controllers, namespace, Path(f"/tmp/pv-{namespace}"))
    try:
        yield Cluster(controllers, namespace, sim)
    finally:
        delete_jobs(controllers, namespace)
        sim.stop()


def _selector(selector: dict[str, Any]) -> str:
    """A LabelSelector as a ``labelSelector`` query (the policies here use matchLabels and In expressions)."""
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        assert expression["operator"] == "In", expression
        terms.append(f"{expression['key']} in ({','.join(expression['values'])})")
    return ",".join(terms)


def _pods(plane: ControlPlane, selector: dict[str, Any], namespace: str = "") -> set[str]:
    """``namespace/name`` of the pods the API server selects with ``selector`` (every namespace without one)."""
    where = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
    query = urllib.parse.urlencode({"labelSelector": _selector(selector)})
    items = plane.request("GET", f"{where}?{query}")["items"]
    return {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in items}


def _namespaces(plane: ControlPlane, selector: dict[str, Any]) -> set[str]:
    query = urllib.parse.urlencode({"labelSelector": _selector(selector)})
    return {n["metadata"]["name"] for n in plane.request("GET", f"/api/v1/namespaces?{query}")["items"]}


def _stranger(plane: ControlPlane, namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod that is none of the operator's: ``labels`` are whatever its author chose."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True},
            "containers": [
                {"name": "c", "image": "stranger", "command": ["sleep", "infinity"], "securityContext": RESTRICTED}
            ],
        },
    }
    return eventually(
        lambda: _try(lambda: plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)),
        what=f"pod {namespace}/{name} created (its namespace's ServiceAccount may come later)",
    )


def test_each_jobs_network_policies_select_exactly_its_pods_and_admit_only_its_workers(cluster, controllers, tmp_path):
    ns = cluster.ns
    other = controllers.create_namespace(f"t-other-{cluster.tag}")
    for name in ("np-a", "np-b"):
        cluster.apply(JobBuilder(name), tmp_path)
    eventually(lambda: len(cluster.pods("agent")) == 2 and len(cluster.pods()) == 4, what="pods created")
    uid = cluster.job("np-a")["metadata"]["uid"]
    # Strangers in another namespace with np-a's labels, UID included (it is no secret).
    for role in (constants.ROLE_WORKER, constants.ROLE_AGENT):
        labels = {constants.LABEL_JOB_NAME: "np-a", constants.LABEL_ROLE: role, access.LABEL_JOB_UID: uid}
        _stranger(controllers, other, f"forged-{role}", labels)
    # A scraper-looking pod in another namespace (the default scraper selector: prometheus-operator's Prometheus).
    _stranger(controllers, other, "prometheus", {"app.kubernetes.io/name": "prometheus"})

    def job_pods(name: str, role: str) -> set[str]:
        return {
            f"{ns}/{n}"
            for n, p in cluster.pods(role).items()
            if p["metadata"]["labels"][constants.LABEL_JOB_NAME] == name
        }

    for name in ("np-a", "np-b"):

        def policy(suffix: str, job: str = name) -> dict[str, Any] | None:
            return _try(
                lambda: controllers.request("GET", f"{NETWORKING}/namespaces/{ns}/networkpolicies/{job}-{suffix}")
            )

        agent_policy = eventually(lambda: policy("agent"), what=f"{name}-agent NetworkPolicy")
        worker_policy = eventually(lambda: policy("workers"), what=f"{name}-workers NetworkPolicy")
        workers, agent = job_pods(name, constants.ROLE_WORKER), job_pods(name, constants.ROLE_AGENT)
        assert len(workers) == 2 and len(agent) == 1
        for obj in (agent_policy, worker_policy):
            [owner] = obj["metadata"]["ownerReferences"]
            assert owner["uid"] == cluster.job(name)["metadata"]["uid"]
            assert obj["spec"]["policyTypes"] == ["Ingress"]
        # The policies apply to exactly the job's agent, and to exactly its workers, of the policy's namespace.
        assert _pods(controllers, agent_policy["spec"]["podSelector"], ns) == agent
        assert _pods(controllers, worker_policy["spec"]["podSelector"], ns) == workers
        # To the agent: only the job's workers (no namespaceSelector: the policy's namespace only), store port only;
        # the operator's pods (the chart's namespace and labels), pulse port only.
        rule, from_operator = agent_policy["spec"]["ingress"]
        [peer] = rule["from"]
        assert set(peer) == {"podSelector"}, peer
        assert _pods(controllers, peer["podSelector"], ns) == workers
        assert rule["ports"] == [{"protocol": "TCP", "port": 29400}]
        [operator_peer] = from_operator["from"]
        assert _namespaces(controllers, operator_peer["namespaceSelector"]) == {OPERATOR_NAMESPACE}
        assert operator_peer["podSelector"]["matchLabels"].items() <= chart_operator_pod_labels().items()
        assert from_operator["ports"] == [{"protocol": "TCP", "port": 29401}]
        # To the workers: the job's workers on every port, the scraper on the metrics port.
        from_workers, from_scraper = worker_policy["spec"]["ingress"]
        [peer] = from_workers["from"]
        assert set(peer) == {"podSelector"} and "ports" not in from_workers, from_workers
        assert _pods(controllers, peer["podSelector"], ns) == workers
        [scraper] = from_scraper["from"]
        assert from_scraper["ports"] == [{"protocol": "TCP", "port": 9400}]
        scraped = {
            f"{n}/{p}"
            for n in _namespaces(controllers, scraper["namespaceSelector"])
            for p in (s.split("/", 1)[1] for s in _pods(controllers, scraper["podSelector"], n))
        }
        assert f"{other}/prometheus" in scraped
        assert not scraped & {*workers, *agent, f"{other}/forged-worker", f"{other}/forged-agent"}, scraped
    # np-a's and np-b's selectors never pick each other's pods.
    a_workers = {
        "matchLabels": {
            constants.LABEL_JOB_NAME: "np-a",
            constants.LABEL_ROLE: constants.ROLE_WORKER,
            access.LABEL_JOB_UID: uid,
        }
    }
    assert _pods(controllers, a_workers, ns) == job_pods("np-a", constants.ROLE_WORKER)
    assert _pods(controllers, a_workers) == {*job_pods("np-a", constants.ROLE_WORKER), f"{other}/forged-worker"}, (
        "across namespaces the labels match the forged pod: only the policy's namespace keeps it out"
    )


@pytest.fixture
def process_cluster(controllers, namespace, operator, tmp_path, fork_servers) -> Iterator[tuple[Cluster, str]]:
    """Kubelets that run every pod as local processes, in the job's namespace and in an outsider's."""
    other = controllers.create_namespace(f"t-outsider-{namespace[2:]}")
    volume_root = tmp_path / "volume"
    volume_root.mkdir()
    checkpoint_claim(controllers, namespace, volume_root)
    sim = ProcessKubelets(
        controllers, volume_root, tmp_path / "pods", namespaces={namespace, other}, forks=fork_servers
    )
    try:
        yield Cluster(controllers, namespace, sim), other
    finally:
        delete_jobs(controllers, namespace)
        sim.stop()


OUTSIDER_ATTACKS = "list,forge,pickle,delete,raw"
OUTSIDER_SECONDS = 5
OUTSIDER_FLOOD_MB = 512


@pytest.mark.timeout(420)
def test_an_outsider_in_another_namespace_costs_a_training_job_nothing(process_cluster, tmp_path):
    """A pod in another namespace runs ``tests/security/outsider.py`` (no secret) against the job agent's Service
    address while the job trains: a plain TCPStore client's list, forge, pickle and delete attacks, then the raw
    abuses on the wire (1,000 idle connections, queues, pipelined reads, half-sent values, long key names, an
    append). None gets past the store front's handshake; the job Succeeds, no restart is charged, and the pickle's
    file never appears.

    NetworkPolicy is not enforced on this tier (no network plugin), so the outsider does reach the store's port:
    this is the front holding where the policy does not."""
    cluster, other = process_cluster
    cluster.nodes(4)
    name = "np-train"
    job = (
        e2e_job(name, tmp_path / "records", replicas=2, max_steps=1500, dataset=60_000, step_sleep=0.05)
        .set("spec.checkpoint", {"claimName": "ckpt", "path": "/ckpt", "intervalSteps": 20, "keep": 3})
        .set("spec.restartPolicy", {"backoffSeconds": 0, "maxRestarts": 5})
    )
    cluster.apply(job, tmp_path)

    def training(step: int) -> dict[str, Any] | None:
        status = cluster.status(name)
        return status if status.get("phase") == "Running" and status.get("step", 0) >= step else None

    eventually(lambda: training(10), timeout=180, what="2 nodes training (real agent progress)")
    marker, report = tmp_path / "outsider-ran", tmp_path / "outsider.json"
    address = f"{name}-agent.{cluster.ns}.svc:29400"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "outsider", "namespace": other},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "outsider",
                    "image": "outsider",
                    "securityContext": RESTRICTED,
                    "command": ["python", "tests/security/outsider.py"],
                    "args": [
                        address,
                        OUTSIDER_ATTACKS,
                        "--seconds",
                        str(OUTSIDER_SECONDS),
                        "--marker",
                        str(marker),
                        "--report",
                        str(report),
                        "--max-flood-mb",
                        str(OUTSIDER_FLOOD_MB),
                    ],
                }
            ],
        },
    }
    started = time.monotonic()
    eventually(
        lambda: _try(lambda: cluster.plane.request("POST", f"/api/v1/namespaces/{other}/pods", pod)),
        what="outsider pod created (its namespace's ServiceAccount may come later)",
    )

    def outsider_done() -> dict[str, Any] | None:
        got = cluster.plane.request("GET", f"/api/v1/namespaces/{other}/pods/outsider")
        return got if got["status"].get("phase") in ("Succeeded", "Failed") else None

    done = eventually(outsider_done, timeout=180, interval=0.5, what="the outsider's attacks over")
    attack_seconds = time.monotonic() - started
    log = cluster.kubelets.log_of("outsider")
    status_then = cluster.status(name)
    assert report.exists(), f"the outsider wrote no report (pod {done['status'].get('phase')}):\n{log[-3000:]}"
    attacks = json.loads(report.read_text())
    assert sum(attacks.get("errors", {}).values()) > 0, f"the outsider made no attempt:\n{log[-3000:]}"
    assert attacks.get("keys_seen") == [], f"the outsider got past the store front:\n{log[-3000:]}"
    assert not attacks.get("ops", {}).get("connect"), f"a TCPStore client without the secret connected: {attacks}"
    # the attack was really mounted: a rare connect that timed out on a busy machine (the listen backlog full while
    # the front sheds the flood) is the stranger's loss, not the job's
    assert attacks["ops"].get("held", 0) >= 990, (
        f"the raw attack did not hold its connections: {attacks['ops']}, errors {attacks.get('errors')}"
    )
    assert status_then.get("phase") != "Succeeded", (
        "the job was over before the attacks were: make it train longer",
        status_then.get("step"),
    )
    finished = eventually(
        lambda: cluster.phase(name, "Succeeded") or cluster.phase(name, "Failed"),
        timeout=240,
        interval=0.5,
        what="the job Succeeded",
    )
    assert not marker.exists(), f"the attacker's pickle ran in the job: {marker} was created"
    assert finished["phase"] == "Succeeded", (
        finished.get("phase"),
        finished.get("conditions"),
        _evidence(cluster, name, attacks),
    )
    restarts = finished.get("restarts") or {}
    assert not restarts.get("total") and not restarts.get("byReason"), (
        f"restarts charged: {restarts}\n{_evidence(cluster, name, attacks)}"
    )
    print(
        f"outsider from namespace {other}: {OUTSIDER_ATTACKS} for {OUTSIDER_SECONDS} s each, "
        f"{sum(attacks.get('ops', {}).values())} ops, {attacks.get('bytes_sent', 0) / 2**20:.0f} MiB sent, "
        f"{len(attacks['keys_seen'])} keys seen, over in {attack_seconds:.0f} s; job Succeeded, 0 restarts",
        file=sys.stderr,
    )


def _evidence(cluster: Cluster, name: str, attacks: dict[str, Any]) -> str:
    """When each attack ran, the last reform and the agent's warnings: which attack cost what."""
    phases = [
        f"{p['attack']} {time.strftime('%H:%M:%S', time.gmtime(p['start']))}-"
        f"{time.strftime('%H:%M:%S', time.gmtime(p['end']))} ({p['ops']} ops)"
        for p in attacks.get("phases", [])
    ]
    warnings = [
        line
        for line in cluster.kubelets.log_of(f"{name}-agent").splitlines()
        if " WARNING " in line or " ERROR " in line
    ]
    return (
        f"attacks (UTC): {'; '.join(phases)}\nlastReform: {cluster.status(name).get('lastReform')}\n"
        "agent warnings:\n" + "\n".join(warnings[-20:])
    )
