"""The operator on a real control plane: kube-apiserver, etcd, kube-controller-manager and kube-scheduler.

The operator runs as a process under the ServiceAccount and RBAC that the Helm chart installs (token from the
TokenRequest API). The tests play the kubelet (:mod:`tests.cluster.kubelet`) and the job agent, which reports
progress with *its own* ServiceAccount token, so the per-job Role the operator creates is exercised too. Over
the whole module the operator's log must show no 403.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from disttrain.api import constants
from disttrain.api.conditions import format_time
from disttrain.trainer.agent.service import KubeJobSource
from tests.cluster.controlplane import ControlPlane
from tests.cluster.harness import (
    PHASES,
    _try,
    eventually,
    silent_node_reform,
)
from tests.cluster.operator_process import OperatorProcess
from tests.conftest import JobBuilder

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(180)]


def test_created_objects_are_owned_and_collected_by_the_garbage_collector(cluster, tmp_path):
    job = cluster.apply(JobBuilder("gc"), tmp_path)
    uid = job["metadata"]["uid"]
    eventually(lambda: len(cluster.pods("agent")) == 1 and len(cluster.pods()) == 2, what="pods created")
    owned = {
        f"/api/v1/namespaces/{cluster.ns}/services/gc-agent",
        f"/api/v1/namespaces/{cluster.ns}/services/gc-workers",
        f"/api/v1/namespaces/{cluster.ns}/serviceaccounts/gc-agent",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{cluster.ns}/roles/gc-agent",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{cluster.ns}/rolebindings/gc-agent",
        f"/api/v1/namespaces/{cluster.ns}/secrets/gc-store-{uid}",
        f"/apis/networking.k8s.io/v1/namespaces/{cluster.ns}/networkpolicies/gc-agent",
        *(f"/api/v1/namespaces/{cluster.ns}/pods/{name}" for name in ("gc-agent", "gc-worker-0", "gc-worker-1")),
    }
    for path in owned:
        [owner] = eventually(lambda path=path: _try(lambda: cluster.plane.request("GET", path)), what=path)["metadata"][
            "ownerReferences"
        ]
        assert owner == {
            "apiVersion": constants.API_VERSION,
            "kind": constants.KIND,
            "name": "gc",
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    cluster.plane.kubectl("delete", "-n", cluster.ns, "dtj/gc", "--wait=false")

    def collected() -> bool:  # the real garbage collector removes every dependent (no pod was bound: no kubelet wait)
        return all(_gone(cluster.plane, path) for path in owned) and _gone(cluster.plane, cluster.jobs("gc"))

    eventually(collected, timeout=60, what="dependents garbage-collected")


def test_only_the_jobs_pods_mount_its_store_secret_and_only_its_workers_may_reach_the_agent(cluster, tmp_path):
    """The two fences of docs/operator.md ("Who can reach the job agent"), as the real API server stores them."""
    for name in ("fence-a", "fence-b"):
        cluster.apply(JobBuilder(name), tmp_path)
    eventually(lambda: len(cluster.pods("agent")) == 2 and len(cluster.pods()) == 4, what="pods created")
    secrets = {}
    for name in ("fence-a", "fence-b"):
        store = f"{name}-store-{cluster.job(name)['metadata']['uid']}"
        secret = eventually(
            lambda store=store: _try(
                lambda: cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/secrets/{store}")
            ),
            what=store,
        )
        secrets[name] = base64.b64decode(secret["data"]["secret"]).decode()
        assert len(secrets[name]) == 64 and secret["immutable"] is True
        job_pods = [
            p
            for p in [*cluster.pods().values(), *cluster.pods("agent").values()]
            if p["metadata"]["labels"][constants.LABEL_JOB_NAME] == name
        ]
        assert len(job_pods) == 3
        for pod in job_pods:
            [volume] = [v for v in pod["spec"]["volumes"] if "secret" in v]
            assert volume["secret"]["secretName"] == store, pod["metadata"]["name"]
            container = pod["spec"]["containers"][0]
            assert {
                "name": volume["name"],
                "mountPath": "/var/run/secrets/disttrain.dev/store",
                "readOnly": True,
            } in container["volumeMounts"]
            assert {
                "name": "DISTTRAIN_STORE_SECRET_FILE",
                "value": "/var/run/secrets/disttrain.dev/store/secret",
            } in container["env"]
        policy = cluster.plane.request(
            "GET", f"/apis/networking.k8s.io/v1/namespaces/{cluster.ns}/networkpolicies/{name}-agent"
        )["spec"]
        agent_labels = cluster.pods("agent")[f"{name}-agent"]["metadata"]["labels"]
        assert policy["podSelector"]["matchLabels"].items() <= agent_labels.items()
        assert policy["policyTypes"] == ["Ingress"]
        rule, from_operator = policy["ingress"]  # the operator's pods on the pulse port: test_network_policy
        assert from_operator["ports"] == [{"protocol": "TCP", "port": 29401}]
        [peer] = rule["from"]
        assert peer == {
            "podSelector": {
                "matchLabels": {
                    constants.LABEL_JOB_NAME: name,
                    constants.LABEL_ROLE: constants.ROLE_WORKER,
                    "disttrain.dev/job-uid": cluster.job(name)["metadata"]["uid"],
                }
            }
        }
        assert rule["ports"] == [{"protocol": "TCP", "port": 29400}]
    assert secrets["fence-a"] != secrets["fence-b"]


def _gone(plane: ControlPlane, path: str) -> bool:
    try:
        plane.request("GET", path)
    except urllib.error.HTTPError as error:
        error.close()  # it holds the answer's TLS socket: left to the garbage collector it warns in a later test
        return error.code == 404
    return False


def story(cluster, job: str) -> str:
    """What the pods, nodes, Events and status say: which path made a replacement take another name."""
    pods = [
        (n, p["spec"].get("nodeName"), p["status"].get("phase"), p["metadata"].get("deletionTimestamp"))
        for n, p in sorted(cluster.pods().items())
    ]
    nodes = {
        n["metadata"]["name"]: [
            (c["type"], c["status"]) for c in n["status"].get("conditions", []) if c["type"] == "Ready"
        ]
        for n in cluster.plane.request("GET", "/api/v1/nodes")["items"]
    }
    events = [
        (e.get("lastTimestamp") or e.get("eventTime"), e["reason"], e["involvedObject"]["name"], e.get("message", ""))
        for e in cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
        if not e["reason"].startswith("FailedToUpdateEndpoint")  # pod IPs on the loopback: noise here
    ]
    lines = [
        f"pods: {pods}",
        f"nodes: {nodes}",
        *(f"event: {e}" for e in sorted(events, key=str)),
        f"status: {cluster.status(job)}",
    ]
    return "\n".join(lines)


def test_a_node_lost_to_the_node_lifecycle_controller_is_replaced(cluster, tmp_path):
    agent = cluster.running("lost", JobBuilder("lost"), tmp_path, replicas=2)
    # Power off a node that does not host the agent pod: this test is about a worker's node alone (the agent's
    # node is test_losing_the_agents_node_replaces_the_agent_in_seconds_and_charges_no_restart).
    agent_node = cluster.pods("agent")["lost-agent"]["spec"]["nodeName"]
    victim = next(p for _, p in sorted(cluster.pods().items()) if p["spec"]["nodeName"] != agent_node)
    victim_name = victim["metadata"]["name"]
    node = victim["spec"]["nodeName"]
    powered_off = time.monotonic()
    cluster.kubelets.power_off(node)

    def node_unreachable() -> bool:
        taints = cluster.plane.request("GET", f"/api/v1/nodes/{node}")["spec"].get("taints", [])
        return any(t["key"] == "node.kubernetes.io/unreachable" for t in taints)

    eventually(node_unreachable, timeout=60, what="the node-lifecycle controller taints the node")
    reforming = eventually(lambda: cluster.phase("lost", "Reforming"), timeout=30, what="reform")
    detected = time.monotonic() - powered_off
    losses = reforming["infrastructureLosses"]["byReason"]
    assert losses == {"NodeUnreachable": 1}, reforming  # Ready=Unknown: no heartbeat
    assert reforming["control"]["action"] == "reform"

    def replaced() -> dict[str, Any] | None:
        workers = cluster.live_workers()
        fresh = [p for p in workers.values() if p["metadata"]["name"] not in ("lost-worker-0", "lost-worker-1")]
        return fresh[0] if fresh and fresh[0]["spec"].get("nodeName") not in (None, node) else None

    replacement = eventually(replaced, timeout=30, what="a replacement scheduled on another node")
    # It takes the lost pod's node index, and with it the lost node's ranks, under a name of its own.
    assert replacement["metadata"]["name"] == f"{victim_name}-1", story(cluster, "lost")
    index = victim["metadata"]["labels"]["disttrain.dev/node-index"]
    assert replacement["metadata"]["labels"]["disttrain.dev/node-index"] == index
    lost = cluster.pods()[victim_name]  # no kubelet confirms its deletion: Terminating, as in a real cluster
    assert lost["metadata"].get("deletionTimestamp") and lost["metadata"]["uid"] == victim["metadata"]["uid"]
    assert {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 10,
    } in lost["spec"]["tolerations"], "taint-based eviction applies to workers"
    eventually(lambda: cluster.pods()[replacement["metadata"]["name"]]["status"].get("phase") == "Running")
    cluster.agent_reports(
        "lost", agent, worldSize=2, step=4, rendezvousRound=2, lastProgressTime=format_time(time.time())
    )
    status = eventually(lambda: cluster.phase("lost", "Running"), what="back to Running")
    assert status["restarts"]["total"] == 0 and status["lastReform"]["to"] == 2, "a node loss is no restart"
    assert status["infrastructureLosses"]["total"] == 1
    print(f"node power-off -> reform directive: {detected:.1f} s")


def test_scale_down_and_up_through_the_scale_subresource(cluster, tmp_path):
    agent = cluster.running("sc", JobBuilder("sc"), tmp_path, replicas=3)
    cluster.plane.kubectl("scale", "-n", cluster.ns, "dtj/sc", "--replicas=2")
    drain = eventually(lambda: cluster.phase("sc", "Reforming"), what="drain")
    assert drain["control"]["action"] == "drain" and drain["control"]["exclude"] == ["sc-worker-2"]
    assert "sc-worker-2" in cluster.live_workers(), "a victim waits for the drain checkpoint"
    cluster.agent_reports("sc", agent, lastCheckpoint={"step": 10, "time": format_time(time.time() + 1)})
    eventually(lambda: sorted(cluster.pods()) == ["sc-worker-0", "sc-worker-1"], what="victim deleted")
    cluster.agent_reports("sc", agent, worldSize=2, rendezvousRound=2, lastProgressTime=format_time(time.time() + 2))
    down = eventually(lambda: cluster.phase("sc", "Running"), what="Running at 2")
    assert down["restarts"]["total"] == 0 and down["lastReform"]["to"] == 2

    cluster.plane.kubectl("scale", "-n", cluster.ns, "dtj/sc", "--replicas=3")
    eventually(lambda: len(cluster.live_workers()) == 3, what="a third worker created")
    eventually(lambda: all(p["status"].get("phase") == "Running" for p in cluster.pods().values()))
    up = eventually(lambda: cluster.phase("sc", "Reforming"), what="scale-up directive")
    cluster.agent_reports(
        "sc",
        agent,
        lastCheckpoint={"step": 20, "time": format_time(time.time() + 3)},
        worldSize=3,
        rendezvousRound=3,
        lastProgressTime=format_time(time.time() + 4),
    )
    done = eventually(lambda: cluster.phase("sc", "Running"), what="Running at 3")
    assert up["control"]["action"] in ("drain", "reform") and done["lastReform"]["to"] == 3
    assert done["restarts"]["total"] == 0
    scale = cluster.plane.request("GET", cluster.jobs("sc", "scale"))
    assert scale["status"]["replicas"] == 3 and scale["status"]["selector"]


def test_suspend_removes_pods_and_resume_recreates_them(cluster, tmp_path):
    agent = cluster.running("sus", JobBuilder("sus"), tmp_path, replicas=2)
    cluster.agent_reports("sus", agent, lastCheckpoint={"step": 30, "time": format_time(time.time())})
    cluster.plane.kubectl(
        "patch", "-n", cluster.ns, "dtj/sus", "--type=merge", "-p", '{"spec": {"runPolicy": {"suspend": true}}}'
    )
    status = eventually(lambda: cluster.phase("sus", "Suspended"), what="Suspended")
    eventually(lambda: not cluster.pods() and not cluster.pods("agent"), what="pods removed")
    assert status["lastCheckpoint"]["step"] == 30
    cluster.plane.kubectl(
        "patch", "-n", cluster.ns, "dtj/sus", "--type=merge", "-p", '{"spec": {"runPolicy": {"suspend": false}}}'
    )
    eventually(lambda: len(cluster.live_workers()) == 2 and len(cluster.pods("agent")) == 1, what="pods recreated")

    def reasons() -> set[str]:
        events = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
        return {e["reason"] for e in events if e["involvedObject"].get("name") == "sus"}

    # The operator posts a reconcile's Events after its creations: the pods can be seen before the Event.
    eventually(lambda: {"Suspended", "Resumed"} <= reasons(), what="Suspended and Resumed events")


def test_a_stale_resource_version_conflicts_and_changes_nothing(cluster, tmp_path):
    agent = cluster.running("rv", JobBuilder("rv"), tmp_path, replicas=1)
    stale = cluster.job("rv")
    cluster.agent_reports("rv", agent, step=7, lastProgressTime=format_time(time.time()))
    eventually(lambda: cluster.job("rv")["metadata"]["resourceVersion"] != stale["metadata"]["resourceVersion"])
    stale["spec"]["nodes"]["replicas"] = 2
    with pytest.raises(urllib.error.HTTPError) as conflict:
        cluster.plane.request("PUT", cluster.jobs("rv"), stale)
    assert conflict.value.code == 409
    after = cluster.job("rv")
    assert after["spec"]["nodes"]["replicas"] == 1 and after["status"]["step"] == 7
    # The operator's own writes are merge patches of the fields it owns: interleaved agent reports survive them.
    for step in range(8, 14):
        cluster.agent_reports("rv", agent, step=step, lastProgressTime=format_time(time.time()))
    final = eventually(lambda: cluster.phase("rv", "Running"))
    assert final["step"] == 13 and final["restarts"]["total"] == 0


def test_an_operator_sigkilled_mid_drain_finishes_it_without_duplicates(cluster, operator, tmp_path):
    agent = cluster.running("kd", JobBuilder("kd"), tmp_path, replicas=3)
    cluster.plane.kubectl("scale", "-n", cluster.ns, "dtj/kd", "--replicas=2")
    before = eventually(lambda: cluster.phase("kd", "Reforming"), what="drain")
    operator.kill()
    cluster.agent_reports("kd", agent, lastCheckpoint={"step": 10, "time": format_time(time.time() + 1)})
    operator.start()
    eventually(lambda: sorted(cluster.pods()) == ["kd-worker-0", "kd-worker-1"], what="victim deleted")
    cluster.agent_reports("kd", agent, worldSize=2, rendezvousRound=2, lastProgressTime=format_time(time.time() + 2))
    done = eventually(lambda: cluster.phase("kd", "Running"), what="Running at 2")
    assert done["control"]["generation"] == before["control"]["generation"], "the drain was not issued twice"
    assert done["restarts"] == before["restarts"] and done["lastReform"]["to"] == 2
    time.sleep(1.5)  # the restarted operator had time to act on everything it saw
    assert sorted(cluster.pods()) == ["kd-worker-0", "kd-worker-1"] and len(cluster.pods("agent")) == 1


def test_the_job_agent_follows_its_job_through_a_watch_under_its_own_role(cluster, tmp_path):
    """The agent's KubeJobSource with the per-job Role (get and watch on its job, no list): a directive reaches it
    through the watch, its status patch is allowed and is what it reads next, and the job's deletion ends it."""
    token = cluster.running("aw", JobBuilder("aw"), tmp_path, replicas=2)
    api = cluster.plane.api_client(token)
    source = KubeJobSource(cluster.ns, "aw", api)
    try:
        assert source.read()["status"]["phase"] == "Running"
        cluster.plane.kubectl("scale", "-n", cluster.ns, "dtj/aw", "--replicas=1")

        def directive() -> str | None:
            source.wait_for_change(0.5)
            action = (source.read()["status"].get("control") or {}).get("action")
            return action if action == "drain" else None

        eventually(directive, what="the drain directive seen through the watch")
        source.patch_status({"step": 42})
        assert source.read()["status"]["step"] == 42, "the answer to its own write is what it reads next"
        assert cluster.status("aw")["step"] == 42
        owners = _status_field_owners(cluster.job("aw"))
        assert owners["step"] == "disttrain-agent", owners
        assert owners["control"] == owners["conditions"] == "disttrain-operator", owners
        cluster.plane.kubectl("delete", "-n", cluster.ns, "dtj/aw", "--wait=false")
        eventually(lambda: source.read() is None, timeout=60, what="the deletion seen through the watch")
    finally:
        source.close()
        api.close()


def _status_field_owners(job: dict[str, Any]) -> dict[str, str]:
    """Top-level status field -> the field manager that last wrote it (``metadata.managedFields``, status entries)."""
    owners: dict[str, str] = {}
    for entry in job["metadata"].get("managedFields") or []:
        for field in (entry.get("fieldsV1") or {}).get("f:status", {}):
            if field.startswith("f:"):
                owners[field[2:]] = entry["manager"]
    return owners


def _scrape(operator: OperatorProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_metric_labels_come_from_our_enums(cluster, operator, tmp_path):
    """A byReason key or reform reason that is not ours never becomes a label (nor injects text into /metrics)."""
    cluster.running("mx", JobBuilder("mx"), tmp_path, replicas=1)
    # As a cluster admin: the status guard keeps the agent's token off these fields (see the test below).
    cluster.plane.request(
        "PATCH",
        cluster.jobs("mx", "status"),
        {
            "status": {
                "restarts": {"total": 0, "byReason": {"PodFailed": 0, 'x"} 1\nevil': 3}},
                "reforms": 1,
                "lastReform": {"reason": "made-up", "start": format_time(time.time()), "from": 1, "to": 1},
            }
        },
        content_type="application/merge-patch+json",
    )
    eventually(lambda: 'reason="Other"} 3.0' in _scrape(operator), what="the unknown reason counted as Other")
    text = _scrape(operator)
    assert "evil" not in text and "made-up" not in text, [line for line in text.splitlines() if "mx" in line]


def test_a_deleted_jobs_series_go_when_its_deletion_begins(cluster, operator, tmp_path):
    """On a real control plane a deleted job's series were still exported minutes later: a deletion can take that
    long (foreground deletion waiting for pods on a lost node; here a finalizer of our own), and the series must
    go when it begins, not when the object is finally gone, and no late reconcile may bring them back."""
    cluster.running("dx", JobBuilder("dx"), tmp_path, replicas=1)
    series = f'job="dx",namespace="{cluster.ns}"'
    eventually(lambda: series in _scrape(operator), what="the job's series")
    finalizers = [*cluster.job("dx")["metadata"].get("finalizers", []), "test.disttrain.dev/hold"]
    cluster.plane.request(
        "PATCH",
        cluster.jobs("dx"),
        {"metadata": {"finalizers": finalizers}},
        content_type="application/merge-patch+json",
    )
    cluster.plane.kubectl("delete", "-n", cluster.ns, "dtj/dx", "--wait=false")
    eventually(lambda: series not in _scrape(operator), timeout=20, what="the deleting job's series removed")
    time.sleep(1.0)
    assert series not in _scrape(operator), "a late reconcile brought them back"
    left = [f for f in cluster.job("dx")["metadata"].get("finalizers", []) if f != "test.disttrain.dev/hold"]
    cluster.plane.request(
        "PATCH",
        cluster.jobs("dx"),
        {"metadata": {"finalizers": left or None}},
        content_type="application/merge-patch+json",
    )
    eventually(lambda: _gone(cluster.plane, cluster.jobs("dx")), timeout=60, what="job deleted")
    assert series not in _scrape(operator)


def test_the_agent_may_report_progress_but_never_change_what_the_operator_remembers(cluster, tmp_path):
    """The agent's token may patch the status subresource (RBAC cannot narrow it to fields); the chart's status
    guard refuses every change it would make to the operator's fields: the restart budget, the pods already
    counted, the directive, the phase."""
    agent = cluster.running("sg", JobBuilder("sg"), tmp_path, replicas=1)
    spent = {"total": 3, "byReason": {"PodFailed": 3}}  # three restarts counted (written here as the admin)
    cluster.plane.request(
        "PATCH",
        cluster.jobs("sg", "status"),
        {"status": {"restarts": spent}},
        content_type="application/merge-patch+json",
    )
    before = eventually(lambda: (lambda st: st if st.get("restarts") == spent else None)(cluster.status("sg")))
    forged = {
        "restarts": {"total": 0, "byReason": {}},
        "handledPods": ["uid-x"],
        "phase": "Succeeded",
        "trackedPods": ["sg-worker-[0]"],
        "control": {"generation": 99, "action": "reform"},
        "consecutiveFailures": 7,
    }
    for field, value in forged.items():
        result = cluster.plane.kubectl(
            "patch",
            "-n",
            cluster.ns,
            f"{constants.PLURAL}/sg",
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {field: value, "step": 9}}),
            kubeconfig=agent,
            check=False,
        )
        assert result.returncode != 0 and f"status.{field} is the operator's" in result.stderr, (field, result)
    after = cluster.status("sg")
    assert {k: after.get(k) for k in forged} == {k: before.get(k) for k in forged}
    assert after.get("step") == before.get("step"), "a refused update changes nothing, not even the agent's part"
    cluster.agent_reports("sg", agent, step=11, lastProgressTime=format_time(time.time()))
    assert cluster.status("sg")["step"] == 11, "progress is still the agent's to report"


AGENT_POOL = "test.disttrain.dev/agent-pool"
"""Label of the nodes that host only job agents in the agent-loss test: no worker shares the agent's node."""


def test_losing_the_agents_node_replaces_the_agent_in_seconds_and_charges_no_restart(cluster, tmp_path):
    """The agent pod on a powered-off node: no kubelet confirms its deletion, so it is force-deleted and recreated at
    once (waiting stuckPodTimeoutSeconds, 300 s, would leave the workers without their store). The workers train on
    and reconnect to the new agent: their pods stay, no restart is charged, no directive is issued. (A worker lost
    with the agent's node is an ordinary node loss: tests/unit/operator/test_reconcile.py.)"""
    for index in range(2):  # two, so that the replacement has a node to go to
        cluster.kubelets.add_node(f"{cluster.tag}-agents{index}", labels={AGENT_POOL: "true"})
    off_the_agent_pool = {"matchExpressions": [{"key": AGENT_POOL, "operator": "DoesNotExist"}]}
    builder = (
        JobBuilder("agentloss")
        .set("spec.agent", {"nodeSelector": {AGENT_POOL: "true"}})
        .set(
            "spec.template.spec.affinity",
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [off_the_agent_pool]}
                }
            },
        )
    )
    agent_token = cluster.running("agentloss", builder, tmp_path, replicas=2)
    old = cluster.pods("agent")["agentloss-agent"]
    node = old["spec"]["nodeName"]
    workers = {n: p["metadata"]["uid"] for n, p in cluster.live_workers().items()}
    assert node not in {p["spec"]["nodeName"] for p in cluster.live_workers().values()}
    control = cluster.status("agentloss")["control"]
    powered_off = time.monotonic()
    cluster.kubelets.power_off(node)

    def node_ready_status() -> str:
        conditions = cluster.plane.request("GET", f"/api/v1/nodes/{node}")["status"].get("conditions", [])
        return next((c["status"] for c in conditions if c["type"] == "Ready"), "")

    eventually(
        lambda: node_ready_status() != "True",
        timeout=60,
        interval=0.1,
        what="the node-lifecycle controller marks the node unreachable",
    )
    node_lost = time.monotonic()

    def new_agent_running() -> bool:
        agent = cluster.pods("agent").get("agentloss-agent")
        return bool(
            agent and agent["metadata"]["uid"] != old["metadata"]["uid"] and agent["status"].get("phase") == "Running"
        )

    eventually(new_agent_running, timeout=60, interval=0.1, what="a new agent pod running")
    agent_replaced = time.monotonic() - node_lost
    status = cluster.status("agentloss")
    assert status.get("agentLostAt"), status
    assert status["restarts"] == {"total": 0, "byReason": {}}, status
    assert status["infrastructureLosses"]["byReason"] == {"AgentRestarted": 1}, status
    assert status["control"] == control, "no directive for the agent's loss"
    assert status["phase"] == "Running", status
    live = cluster.live_workers()
    assert {n: p["metadata"]["uid"] for n, p in live.items()} == workers, "the workers' pods stay"
    assert all(p["status"].get("phase") == "Running" for p in live.values())
    events = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
    [lost] = [e for e in events if e["reason"] == "AgentRestarted" and e["involvedObject"].get("name") == "agentloss"]
    assert lost["type"] == "Warning" and "no restart" in lost["message"] and node in lost["message"], lost

    # The workers report progress through the new agent (with its token): the loss is over once a report is
    # stamped AGENT_RECONNECT_GRACE_S after it.
    step = iter(range(4, 1000))

    def loss_over() -> dict[str, Any] | None:
        cluster.agent_reports("agentloss", agent_token, step=next(step), lastProgressTime=format_time(time.time()))
        current = cluster.status("agentloss")
        return None if current.get("agentLostAt") else current

    status = eventually(loss_over, timeout=60, interval=1, what="agentLostAt cleared by the new agent's progress")
    assert status["restarts"] == {"total": 0, "byReason": {}}, status
    assert status["control"] == control and status["phase"] == "Running", status
    assert {n: p["metadata"]["uid"] for n, p in cluster.live_workers().items()} == workers
    print(
        f"power-off -> agent node NotReady: {node_lost - powered_off:.1f} s; "
        f"agent node NotReady -> new agent Running: {agent_replaced:.1f} s"
    )


def test_pods_refused_by_pod_security_admission_are_named_in_the_status_and_an_event(cluster, tmp_path):
    cluster.plane.request(
        "PATCH",
        f"/api/v1/namespaces/{cluster.ns}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}},
        content_type="application/merge-patch+json",
    )
    cluster.nodes(2)
    builder = JobBuilder("psa").set(
        "spec.template.spec.containers",
        [
            {
                "name": "trainer",
                "image": "example/trainer:1",
                "command": ["python", "train.py"],
                "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
            }
        ],
    )
    cluster.apply(builder, tmp_path)

    def rejected() -> dict[str, Any] | None:
        status = cluster.status("psa")
        scheduled = next((c for c in status.get("conditions", []) if c["type"] == "Scheduled"), {})
        return status if scheduled.get("reason") == "PodRejected" else None

    status = eventually(rejected, timeout=60, what="Scheduled=False PodRejected")
    scheduled = next(c for c in status["conditions"] if c["type"] == "Scheduled")
    assert scheduled["status"] == "False" and "violates PodSecurity" in scheduled["message"], scheduled
    assert "NET_ADMIN" in status["message"]

    def events() -> list[dict[str, Any]]:
        items = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
        return [e for e in items if e["reason"] == "PodRejected" and e["involvedObject"]["name"] == "psa"]

    [event] = eventually(events, what="a PodRejected event")
    assert event["type"] == "Warning" and "violates PodSecurity" in event["message"]
    time.sleep(12)  # one more retry of the creation (every 10 s): the same answer is no new event
    assert len(events()) == 1


@pytest.mark.timeout(300)
def test_a_silent_node_is_reformed_from_its_heartbeats_before_kubernetes_marks_it_not_ready(process_cluster, tmp_path):
    """Real processes on a real control plane: the agent, torchrun and the trainer of every pod run. A machine dies
    (its processes SIGKILLed, its Lease no longer renewed); the job agent finds the node silent in the rendezvous
    heartbeats and the operator reforms at once, long before the node-lifecycle controller (grace period 20 s) marks
    the node NotReady. The replacement joins, the group trains at 3 nodes again, and the reform's phases are in the
    status."""
    seen = silent_node_reform(process_cluster, tmp_path)
    assert seen.control["reason"] == "HeartbeatLost", seen.control
    assert seen.victim in seen.control["exclude"]
    assert seen.node_ready_at_directive == ["True"], "the directive must come before Kubernetes marks the node NotReady"
    assert seen.status["infrastructureLosses"]["byReason"] == {"HeartbeatLost": 1}, seen.status
    assert seen.status["restarts"]["total"] == 0, seen.status["restarts"]
    phases = seen.status["lastReform"]["phases"]
    assert all(phases[p] >= 0 for p in PHASES) and abs(sum(phases[p] for p in PHASES) - phases["total"]) < 0.01, phases
    print(
        f"real control plane: node power-off -> reform directive {seen.detect_seconds:.1f} s (HeartbeatLost); "
        + ", ".join(f"{p} {phases[p]:.2f}" for p in (*PHASES, "total"))
    )
