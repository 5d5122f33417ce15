"""Run the real helm on charts/disttrain: find the binary, lint, render into objects.

Shared with tests/cluster (which applies the rendered objects to a real API server). helm comes from
``scripts/get_helm.py`` (``make test`` runs it); without it a developer's run skips, CI's (``CI=true``) fails.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

import pytest
import yaml
from tests.conftest import REPO_ROOT

CHART = REPO_ROOT / "charts" / "disttrain"
RELEASE = "disttrain"
NAMESPACE = "disttrain-system"


def object_name(release: str = RELEASE) -> str:
    """The name the chart gives its ServiceAccount, Deployment and RBAC objects (no fullnameOverride)."""
    return f"{release}-operator"


SERVICE_ACCOUNT = object_name()

NON_DEFAULT_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example/disttrain-operator", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "pull"}],
    "watchNamespaces": ["team-a", "team-b"],
    "logLevel": "debug",
    "replicaCount": 3,
    "leaderElection": {"leaseSeconds": 15, "renewDeadlineSeconds": 10, "retrySeconds": 2},
    "agent": {"image": "registry.example/disttrain-trainer:1.2.3"},
    "networkPolicy": {
        "enabled": False,
        "metricsScraper": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "vmagent"},
                "matchExpressions": [{"key": "team", "operator": "In", "values": ["ops"]}],
            },
        },
    },
    "statusGuard": {"enabled": False},
    "flowControl": {
        "enabled": True,
        "priorityLevel": "workload-low",
        "matchingPrecedence": 2000,
        "progress": {"enabled": False},
    },
    "serviceAccount": {"annotations": {"example.com/role": "operator"}},
    "metrics": {"port": 9191},
    "liveness": {"port": 8181},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "15s", "scrapeTimeout": "5s"},
    "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "10s", "scrapeTimeout": "4s"},
    "prometheusRule": {
        "enabled": True,
        "labels": {"release": "prometheus"},
        "checkpointMaxAgeSeconds": 1800,
        "checkpointTooOldFor": "10m",
        "restartBudgetRatio": 0.5,
        "infrastructureLossRatio": 0.75,
        "reformingFor": "30m",
    },
    "dashboards": {
        "enabled": True,
        "namespace": "monitoring",
        "labels": {"team": "ml"},
        "annotations": {"grafana_folder": "Training"},
    },
    "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
    "podAnnotations": {"example.com/note": "x"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
                ]
            }
        }
    },
    "podSecurityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},  # merged into defaults
    "securityContext": {"runAsNonRoot": True},
}
"""Every key set to something other than its default: the chart must lint, render and validate with it."""


def find_helm() -> Optional[str]:
    """$DISTTRAIN_HELM, else the venv's bin/ (where scripts/get_helm.py puts it), else $PATH."""
    if os.environ.get("DISTTRAIN_HELM"):
        return os.environ["DISTTRAIN_HELM"]
    beside = pathlib.Path(sys.executable).parent / "helm"
    return str(beside) if beside.is_file() else shutil.which("helm")


def helm_binary() -> str:
    """The helm to run; a missing one skips the test, except under CI where it is a failure."""
    found = find_helm()
    if found:
        return found
    message = "helm not found: run `make test` or `python scripts/get_helm.py` (puts it beside the venv's python)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def helm(*args: str, values: Optional[dict[str, Any]] = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``helm ARGS [-f values.yaml]``; output captured as text."""
    with tempfile.TemporaryDirectory() as tmp:
        extra: list[str] = []
        if values is not None:
            path = pathlib.Path(tmp) / "values.yaml"
            path.write_text(yaml.safe_dump(values))
            extra = ["--values", str(path)]
        done = subprocess.run(
            [helm_binary(), *args, *extra],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HELM_CACHE_HOME": tmp, "HELM_CONFIG_HOME": tmp, "HELM_DATA_HOME": tmp},
        )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done


def render(
    values: Optional[dict[str, Any]] = None,
    namespace: str = NAMESPACE,
    include_crds: bool = False,
    release: str = RELEASE,
) -> list[dict[str, Any]]:
    """``helm template`` the chart as ``release`` in ``namespace``: the objects it would install."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    out = helm(*args, values=values).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]
