"""Restricted Pod Security defaults for the pods the operator builds. Pure: dicts in, dicts changed in place.

Every pod we create passes the ``restricted`` Pod Security Standard
(https://kubernetes.io/docs/concepts/security/pod-security-standards/) unless the user's template says otherwise:
each default is set only where the template left the field out, so a template that needs, say, a capability or
``runAsNonRoot: false`` keeps it (and runs only in namespaces whose admission level allows it).

The defaults: ``runAsNonRoot: true`` and ``seccompProfile: RuntimeDefault`` on the pod; on every container and
init container ``allowPrivilegeEscalation: false`` and ``capabilities.drop: [ALL]``. ``runAsNonRoot`` makes the
kubelet refuse an image whose user is root (the disttrain images run as 65532); such an image needs
``runAsUser`` (non-zero) in the template, or ``runAsNonRoot: false`` outside restricted namespaces.
"""

from __future__ import annotations

from typing import Any

RUNTIME_DEFAULT_SECCOMP = {"type": "RuntimeDefault"}


def apply_restricted_defaults(pod_spec: dict[str, Any]) -> None:
    """Fill in what the restricted standard requires, wherever ``pod_spec`` does not set it already."""
    pod_context: dict[str, Any] = pod_spec.setdefault("securityContext", {})
    containers = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    # A container's own setting overrides the pod's, so these pod-level defaults never undo a container's.
    pod_context.setdefault("runAsNonRoot", True)
    pod_context.setdefault("seccompProfile", dict(RUNTIME_DEFAULT_SECCOMP))
    for container in containers:
        context: dict[str, Any] = container.setdefault("securityContext", {})
        context.setdefault("allowPrivilegeEscalation", False)
        context.setdefault("capabilities", {"drop": ["ALL"]})
