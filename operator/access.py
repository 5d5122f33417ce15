"""Who may reach a job's agent store: pure builders of the per-job Secret and NetworkPolicy, and the mount.

Two independent fences (docs/operator.md, "Who can reach the job agent"):

* the **store secret** (:mod:`disttrain.api.storeauth`): a Secret ``<job>-store`` that only the job's pods mount;
  every key of the store lives under a prefix derived from it, so a client without it cannot name any key. This
  holds on every network plugin.
* a **NetworkPolicy** ``<job>-agent`` that admits to the agent's port only the job's own worker pods, where the
  network plugin enforces NetworkPolicy: other pods then cannot even connect (and so cannot fill the agent's
  memory with keys of their own, which the secret alone does not prevent). The operator never connects to the
  store, so it needs no admission; the kubelet's readiness probe comes from the node, which plugins admit.
"""

from __future__ import annotations

import base64
from typing import Any

from disttrain.api import constants, env, storeauth
from disttrain.api.spec import DistTrainJob
from disttrain.operator import names

VOLUME = "disttrain-store-secret"
MOUNT_PATH = "/var/run/secrets/disttrain.dev/store"
SECRET_FILE = f"{MOUNT_PATH}/{storeauth.SECRET_KEY}"


def _metadata(job: DistTrainJob, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {constants.LABEL_JOB_NAME: job.metadata.name, constants.LABEL_ROLE: constants.ROLE_AGENT},
        "ownerReferences": [
            {
                "apiVersion": constants.API_VERSION,
                "kind": constants.KIND,
                "name": job.metadata.name,
                "uid": job.metadata.uid or "",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def build_store_secret(job: DistTrainJob, secret: str) -> dict[str, Any]:
    """The job's store secret (created once: a repeated create is a 409 and the first secret stays)."""
    encoded = base64.b64encode(secret.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, names.store_secret_name(job.metadata.name)),
        "type": "Opaque",
        "immutable": True,
        "data": {storeauth.SECRET_KEY: encoded},
    }


def build_network_policy(job: DistTrainJob) -> dict[str, Any]:
    """Ingress to the agent pod: only the job's worker pods, only on the store's port."""
    job_name = job.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, names.network_policy_name(job_name)),
        "spec": {
            "podSelector": {
                "matchLabels": {constants.LABEL_JOB_NAME: job_name, constants.LABEL_ROLE: constants.ROLE_AGENT}
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": {
                                    constants.LABEL_JOB_NAME: job_name,
                                    constants.LABEL_ROLE: constants.ROLE_WORKER,
                                }
                            }
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": job.spec.rendezvous.port}],
                }
            ],
        },
    }


def mount_store_secret(job: DistTrainJob, pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
    """Mount the job's store secret read-only into ``container`` and point ``$DISTTRAIN_STORE_SECRET_FILE`` at it
    (replacing anything of that name the template had)."""
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != VOLUME]
    volumes.append({"name": VOLUME, "secret": {"secretName": names.store_secret_name(job.metadata.name)}})
    pod_spec["volumes"] = volumes
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != VOLUME]
    container["volumeMounts"] = [*mounts, {"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}]
    secret_env = (env.STORE_SECRET_FILE, env.STORE_SECRET)
    kept = [e for e in container.get("env") or [] if e.get("name") not in secret_env]
    container["env"] = [*kept, {"name": env.STORE_SECRET_FILE, "value": SECRET_FILE}]
