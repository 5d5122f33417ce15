"""The operator's pods on a real kube-apiserver whose namespace enforces the restricted Pod Security Standard.

PodSecurity admission is the API server's own plugin, so only the real server can say whether a pod passes; no
kubelet runs here, so pods are created with a server dry run (admission runs, nothing is stored).
"""

from __future__ import annotations

import json
import uuid

import pytest

from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods
from tests.cluster.controlplane import ControlPlane
from tests.unit.operator.world import job_manifest

pytestmark = pytest.mark.timeout(180)
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


def _dry_run(plane: ControlPlane, obj: dict) -> str:
    """ "" when admitted, else the server's refusal."""
    done = plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)
    return "" if done.returncode == 0 else done.stderr


def test_worker_and_agent_pods_are_admitted_where_restricted_is_enforced(control_plane):
    namespace = control_plane.create_namespace(f"pss-{uuid.uuid4().hex[:8]}", labels=RESTRICTED)
    manifest = job_manifest("pss")
    manifest["metadata"]["namespace"] = namespace
    job = DistTrainJob.model_validate(manifest)
    account = pods.build_service_account(job)
    del account["metadata"]["ownerReferences"]  # no such job exists: the garbage collector would delete it at once
    control_plane.kubectl("create", "-f", "-", input=json.dumps(account))
    # The controller-manager creates it when another module of this run started the controllers; else we do.
    made = control_plane.kubectl("create", "serviceaccount", "default", "-n", namespace, check=False)
    assert made.returncode == 0 or "already exists" in made.stderr, made.stderr
    worker, agent = pods.build_worker_pod(job, 0), pods.build_agent_pod(job)
    assert _dry_run(control_plane, worker) == ""
    assert _dry_run(control_plane, agent) == ""

    weak = json.loads(json.dumps(worker))  # the namespace really enforces: what the defaults fix is refused
    del weak["spec"]["containers"][0]["securityContext"]
    refused = _dry_run(control_plane, weak)
    assert "violates PodSecurity" in refused and "allowPrivilegeEscalation" in refused, refused
