"""The Helm chart's objects on a real kube-apiserver: they apply (server dry run, then for real), the operator's
ServiceAccount may do what kopf and the adapter do and nothing it should not, RBAC lets it create the per-job
agent Role, and PodSecurity admits its pod in a namespace that enforces the restricted standard.

Only the real server decides RBAC (the first real run of the old deploy/ showed kopf forbidden to list CRDs).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from disttrain.api.constants import GROUP, VERSION
from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods
from tests.chart.helm import by_kind, object_name, render
from tests.chart.rbac import CLUSTER_SCOPED, Permission, needed
from tests.cluster.controlplane import ControlPlane, free_port
from tests.cluster.operator_process import FORBIDDEN, NOT_RBAC
from tests.unit.operator.world import job_manifest

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


def _apply(plane: ControlPlane, objects: list[dict[str, Any]]) -> None:
    """Server-side apply (as Helm 4 does; the CRD is too large for client-side apply's annotation): a server dry
    run of everything first, then for real."""
    manifest = yaml.safe_dump_all(objects)
    plane.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=manifest)
    plane.kubectl("apply", "--server-side", "-f", "-", input=manifest)


def _can_i(plane: ControlPlane, user: str, permission: Permission, namespace: str | None) -> bool:
    group, resource, verb = permission
    resource, _, subresource = resource.partition("/")
    args = ["auth", "can-i", verb, f"{resource}.{group}" if group else resource, f"--as={user}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    if resource not in CLUSTER_SCOPED:
        args += ["--all-namespaces"] if namespace is None else ["-n", namespace]
    answer = plane.kubectl(*args, check=False)
    assert answer.stdout.strip() in ("yes", "no"), answer.stderr
    return answer.stdout.strip() == "yes"


def _eventually_allowed(plane: ControlPlane, user: str, permissions: set[Permission], namespace: str | None) -> None:
    """The authorizer follows RBAC objects through a watch: a fresh binding can take a moment to count."""
    deadline = time.monotonic() + 15
    while True:
        denied = sorted(p for p in permissions if not _can_i(plane, user, p, namespace))
        if not denied or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert denied == [], f"{user} may not (in {namespace or 'all namespaces'}): {denied}"


def _release(plane: ControlPlane, values: dict[str, Any] | None) -> tuple[str, str, list[dict[str, Any]]]:
    """Install the chart's objects under a unique release name (its ClusterRole is cluster-wide) into a fresh
    namespace that enforces the restricted Pod Security Standard; (namespace, user, objects)."""
    release = f"r{uuid.uuid4().hex[:8]}"
    namespace = plane.create_namespace(f"{release}-system", labels=RESTRICTED)
    objects = render(values, namespace=namespace, release=release, include_crds=True)
    _apply(plane, objects)
    return namespace, f"system:serviceaccount:{namespace}:{object_name(release)}", objects


def _agent_role(namespace: str) -> dict[str, Any]:
    manifest = job_manifest(f"job-{uuid.uuid4().hex[:6]}")
    manifest["metadata"]["namespace"] = namespace
    return pods.build_role(DistTrainJob.model_validate(manifest))


def _create_as(plane: ControlPlane, user: str, obj: dict[str, Any]) -> Any:
    return plane.kubectl("create", f"--as={user}", "-f", "-", input=json.dumps(obj), check=False)


def _assert_may_create_agent_role(plane: ControlPlane, user: str, namespace: str) -> None:
    """RBAC's escalation check: the operator may create the agent Role, but not one granting more than it holds."""
    done = _create_as(plane, user, _agent_role(namespace))
    assert done.returncode == 0, done.stderr
    greedy = _agent_role(namespace)
    greedy["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    refused = _create_as(plane, user, greedy)
    assert refused.returncode != 0 and "grant RBAC permissions not currently held" in refused.stderr, refused.stderr


@pytest.mark.usefixtures("pod_group_crds")  # kubectl auth can-i resolves podgroups by discovery
def test_default_values_on_the_server(control_plane: ControlPlane):
    plane = control_plane
    namespace, user, objects = _release(plane, None)
    want = needed(_agent_role("default")["rules"], all_namespaces=True)
    _eventually_allowed(plane, user, want, namespace=None)
    for forbidden in [
        ("", "secrets", "get"),
        ("", "nodes", "delete"),
        ("", "namespaces", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "create"),
        ("", "pods", "patch"),
    ]:
        assert not _can_i(plane, user, forbidden, None), forbidden
    _assert_may_create_agent_role(plane, user, plane.create_namespace(f"jobs-{uuid.uuid4().hex[:6]}"))
    _assert_may_update_only_its_leader_lease(plane, user, namespace, objects)
    _assert_operator_pod_is_admitted(plane, namespace, objects)
    _assert_operator_requests_have_their_own_priority_level(plane, namespace, user, objects)


def _assert_may_update_only_its_leader_lease(
    plane: ControlPlane, user: str, namespace: str, objects: list[dict[str, Any]]
) -> None:
    """The replicas' election: update (a write at the version read) on the chart's own Lease, no other."""
    [role] = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-leader")]
    [lease] = role["rules"][1]["resourceNames"]

    def can_update(name: str) -> bool:
        args = ["auth", "can-i", "update", f"leases.coordination.k8s.io/{name}", f"--as={user}", "-n", namespace]
        return plane.kubectl(*args, check=False).stdout.strip() == "yes"

    deadline = time.monotonic() + 15  # the authorizer follows a fresh binding through a watch
    while not can_update(lease) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert can_update(lease), lease
    assert not can_update("kube-scheduler") and not can_update(f"{lease}-other")


def _token(plane: ControlPlane, namespace: str, account: str) -> str:
    """A token of ServiceAccount ``namespace/account`` (TokenRequest)."""
    return plane.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}},
    )["status"]["token"]


def _flow_schema_of(plane: ControlPlane, token: str, method: str = "GET", path: str = "/version") -> tuple[str, str]:
    """(FlowSchema uid, PriorityLevelConfiguration uid) the API server's priority and fairness gave a request made
    with ``token`` (the response headers say which, refusals' included: priority and fairness classifies a request
    before it is authorized)."""
    context = ssl.create_default_context(cafile=str(plane.pki.ca_crt))
    body = b"{}" if method == "PATCH" else None
    request = urllib.request.Request(
        plane.server + path,
        data=body,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"},
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            headers = response.headers
    except urllib.error.HTTPError as refused:  # 403/404: classified all the same
        headers = refused.headers
    return headers["X-Kubernetes-PF-FlowSchema-UID"], headers["X-Kubernetes-PF-PriorityLevel-UID"]


def _first_progress_schema(plane: ControlPlane, flow: str) -> dict[str, Any]:
    """Of the chart's progress FlowSchemas on the server (one per release installed), the one priority and fairness
    tries first: the lowest matchingPrecedence, then the lowest name."""
    schemas = plane.request("GET", f"{flow}/flowschemas")["items"]
    ours = [
        s
        for s in schemas
        if s["metadata"]["name"].endswith("-progress") and "helm.sh/chart" in s["metadata"].get("labels", {})
    ]
    return min(ours, key=lambda s: (s["spec"]["matchingPrecedence"], s["metadata"]["name"]))


def _assert_operator_requests_have_their_own_priority_level(
    plane: ControlPlane, namespace: str, user: str, objects: list[dict[str, Any]]
) -> None:
    """The chart's FlowSchema takes the operator's requests out of the level every job agent shares, and the agents'
    progress writes (only those) go to the chart's bounded level."""
    schemas = {obj["metadata"]["name"]: obj for obj in by_kind(objects, "FlowSchema")}
    [(progress_name, _)] = [(name, obj) for name, obj in schemas.items() if name.endswith("-progress")]
    [operator_name] = set(schemas) - {progress_name}
    flow = "/apis/flowcontrol.apiserver.k8s.io/v1"
    ours = plane.request("GET", f"{flow}/flowschemas/{operator_name}")
    level = plane.request("GET", f"{flow}/prioritylevelconfigurations/workload-high")
    progress = plane.request("GET", f"{flow}/flowschemas/{progress_name}")
    progress_level = plane.request("GET", f"{flow}/prioritylevelconfigurations/{progress_name}")
    operator = _token(plane, namespace, user.rsplit(":", 1)[1])
    deadline = time.monotonic() + 30  # the API server reloads its FlowSchemas asynchronously
    while _flow_schema_of(plane, operator)[0] != ours["metadata"]["uid"]:
        assert time.monotonic() < deadline, "the operator's requests never matched the chart's FlowSchema"
        time.sleep(0.5)
    assert _flow_schema_of(plane, operator)[1] == level["metadata"]["uid"]
    jobs = plane.create_namespace(f"jobs-{uuid.uuid4().hex[:6]}")
    plane.request(
        "POST",
        f"/api/v1/namespaces/{jobs}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "job-agent"}},
    )
    agent = _token(plane, jobs, "job-agent")
    agent_schema, agent_level = _flow_schema_of(plane, agent)  # a job agent's account, as the operator
    assert agent_schema != ours["metadata"]["uid"] and agent_level != level["metadata"]["uid"]  # names them
    assert agent_level != progress_level["metadata"]["uid"]  # its reads keep their level
    status = f"/apis/{GROUP}/{VERSION}/namespaces/{jobs}/disttrainjobs/job/status"
    winner = _first_progress_schema(plane, flow)  # other releases on this server match the same writes
    assert winner["spec"]["matchingPrecedence"] == progress["spec"]["matchingPrecedence"]
    assert winner["spec"]["rules"] == progress["spec"]["rules"]
    deadline = time.monotonic() + 30
    while _flow_schema_of(plane, agent, "PATCH", status)[0] != winner["metadata"]["uid"]:
        assert time.monotonic() < deadline, "an agent's status write never matched the chart's progress FlowSchema"
        time.sleep(0.5)
    winner_level = plane.request(
        "GET", f"{flow}/prioritylevelconfigurations/{winner['spec']['priorityLevelConfiguration']['name']}"
    )
    assert winner_level["spec"] == progress_level["spec"]  # the chart's bounded level, whichever release made it
    assert _flow_schema_of(plane, agent, "PATCH", status)[1] == winner_level["metadata"]["uid"]
    # The operator's own status writes stay in its level (its FlowSchema comes first).
    assert _flow_schema_of(plane, operator, "PATCH", status)[0] == ours["metadata"]["uid"]


@pytest.mark.usefixtures("pod_group_crds")  # kubectl auth can-i resolves podgroups by discovery
def test_watch_namespaces_on_the_server(control_plane: ControlPlane, namespace: str):
    plane = control_plane
    watched = [plane.create_namespace(f"team-{uuid.uuid4().hex[:6]}") for _ in range(2)]
    release_ns, user, objects = _release(plane, {"watchNamespaces": watched})
    want = needed(_agent_role(watched[0])["rules"], all_namespaces=False)
    cluster = {p for p in want if p[1] in CLUSTER_SCOPED}
    _eventually_allowed(plane, user, cluster, namespace=None)
    for ns in watched:
        _eventually_allowed(plane, user, want - cluster, namespace=ns)
        _assert_may_create_agent_role(plane, user, ns)
    for permission in sorted(want - cluster):  # not in a namespace it does not serve, nor cluster-wide
        assert not _can_i(plane, user, permission, namespace), (namespace, permission)
        assert not _can_i(plane, user, permission, None), permission
    _assert_operator_pod_is_admitted(plane, release_ns, objects)


def _assert_operator_pod_is_admitted(plane: ControlPlane, namespace: str, objects: list[dict[str, Any]]) -> None:
    """No kubelet or controller-manager runs here, so the Deployment's pod is created directly (server dry run):
    PodSecurity admission (enforce=restricted on the namespace) accepts it and refuses a weakened copy."""
    [deployment] = by_kind(objects, "Deployment")
    template = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "operator-pss", "namespace": namespace},
        "spec": template["spec"],
    }
    manifest = json.dumps(pod)
    done = plane.kubectl("create", "--dry-run=server", "-f", "-", input=manifest, check=False)
    assert done.returncode == 0, done.stderr
    weak = json.loads(manifest)
    weak["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(weak), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


def _operator_command(objects: list[dict[str, Any]], kubeconfig: str, liveness_port: int, tmp: Path) -> list[str]:
    """The Deployment's own arguments, run here: its kubeconfig is the ServiceAccount's token, its ports local, and
    its pulse key the chart's Secret written to a file under ``tmp`` (in a pod, the Secret's volume)."""
    [deployment] = by_kind(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if not a.startswith(("--metrics-port=", "--liveness="))]
    flag = "--agent-pulse-key-file="
    if any(a.startswith(flag) for a in args):
        [secret] = [o for o in by_kind(objects, "Secret") if o["metadata"]["name"].endswith("-pulse-key")]
        key_file = tmp / "pulse-key"
        key_file.write_bytes(base64.b64decode(secret["data"]["pulse-key"]))
        args = [f"{flag}{key_file}" if a.startswith(flag) else a for a in args]
    program, *subcommand = container["command"]  # `disttrain operator`: the console script, run as its module
    assert program == "disttrain"
    return [
        sys.executable,
        "-m",
        "disttrain.operator.cli",
        *subcommand,
        *args,
        f"--kubeconfig={kubeconfig}",
        "--metrics-port=0",
        f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
    ]


def _wait_for(what: str, check: Any, log: Path, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what} not within {timeout:.0f} s; operator log:\n{log.read_text()[-4000:]}")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["all-namespaces", "watch-namespaces"])
def test_operator_runs_as_its_service_account(control_plane: ControlPlane, tmp_path: Path, mode: str):
    """``disttrain operator`` with the chart's arguments and its ServiceAccount's token: kopf starts with no
    permission warning, and a job gets its agent RBAC, Services and pods, all created by the operator as that
    ServiceAccount (so the agent Role passes the escalation check with the chart's RBAC, for real)."""
    plane = control_plane
    jobs_ns = plane.create_namespace(f"jobs-{uuid.uuid4().hex[:6]}")
    release_ns, user, objects = _release(plane, {"watchNamespaces": [jobs_ns]} if mode != "all-namespaces" else None)
    plane.wait_established("disttrainjobs.disttrain.dev")
    sa_name = user.rsplit(":", 1)[1]
    kubeconfig = plane.service_account_kubeconfig(release_ns, sa_name)
    log = tmp_path / "operator.log"
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "KUBECONFIG"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _operator_command(objects, str(kubeconfig), port, tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
    try:
        _wait_for("kopf's /healthz", lambda: proc.poll() is None and _healthy(port), log)
        job = job_manifest("rbac-demo")
        job["metadata"] = {"name": "rbac-demo", "namespace": jobs_ns}
        plane.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(job))

        def support_objects() -> bool:
            listed = plane.kubectl(
                "get",
                "-n",
                jobs_ns,
                "serviceaccounts,roles,rolebindings,services,pods",
                "-l",
                "disttrain.dev/job-name=rbac-demo",
                "-o",
                "json",
            ).stdout
            kinds = {item["kind"] for item in json.loads(listed)["items"]}
            return {"ServiceAccount", "Role", "RoleBinding", "Service", "Pod"} <= kinds

        _wait_for("the job's ServiceAccount, Role, RoleBinding, Services and pods", support_objects, log)
        assert proc.poll() is None, log.read_text()[-4000:]
    finally:
        proc.terminate()  # our own child, by its handle
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text()
    refused = [
        line
        for line in text.splitlines()
        if (FORBIDDEN.search(line) and not NOT_RBAC.search(line)) or "Not enough permissions" in line
    ]
    assert not refused, "the operator was refused under the chart's RBAC:\n" + "\n".join(refused[:20])
