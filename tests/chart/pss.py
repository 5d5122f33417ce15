"""The "restricted" Pod Security Standard (Kubernetes 1.33, policy version latest) as a checker of a pod spec.

The real enforcement is the API server's PodSecurity admission (tests/cluster applies the operator's pod to a
namespace labelled enforce=restricted); this offline copy of the rules says which field is wrong.
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every field of ``spec`` (a PodSpec) that the restricted profile refuses, as 'path: what is allowed'."""
    problems: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"spec.{field}: must be unset or false")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volumes[{volume['name']}]: type {sorted(kinds)} not in {sorted(RESTRICTED_VOLUME_TYPES)}")
    if pod_sc.get("runAsUser") == 0:
        problems.append("spec.securityContext.runAsUser: must not be 0")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append("spec.securityContext.seccompProfile.type: must not be Unconfined")
    for container in _containers(spec):
        where = f"containers[{container['name']}].securityContext"
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{where}.privileged: must be unset or false")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}.allowPrivilegeEscalation: must be false")
        run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if run_as_non_root is not True:
            problems.append(f"{where}.runAsNonRoot: must be true (here or in the pod's securityContext)")
        if sc.get("runAsUser") == 0:
            problems.append(f"{where}.runAsUser: must not be 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ALLOWED_SECCOMP:
            problems.append(
                f"{where}.seccompProfile.type: {seccomp!r}, must be one of {sorted(ALLOWED_SECCOMP)} "
                "(here or in the pod's securityContext)"
            )
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{where}.capabilities.drop: must contain ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}.capabilities.add: only NET_BIND_SERVICE is allowed")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"containers[{container['name']}].ports[{port.get('name')}].hostPort: must be unset")
    return problems
