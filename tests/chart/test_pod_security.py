"""The operator's pod meets the restricted Pod Security Standard with the chart's defaults, and changing the
security defaults is noticed (the checker is not vacuous)."""

from __future__ import annotations

import pytest
from tests.chart.helm import NON_DEFAULT_VALUES, by_kind, render
from tests.chart.pss import restricted_violations


def _pod_spec(values):
    [deployment] = by_kind(render(values), "Deployment")
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("values", [None, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_operator_pod_is_restricted(values):
    spec = _pod_spec(values)
    assert restricted_violations(spec) == []
    [container] = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsUser"] != 0


def test_weakened_security_context_is_caught():
    """Values merge into the defaults, so a user removes a default key with null."""
    spec = _pod_spec(
        {
            "podSecurityContext": {"runAsNonRoot": None, "seccompProfile": None},
            "securityContext": {"allowPrivilegeEscalation": None, "capabilities": {"drop": None, "add": ["SYS_ADMIN"]}},
        }
    )
    problems = "\n".join(restricted_violations(spec))
    for field in (
        "allowPrivilegeEscalation",
        "runAsNonRoot",
        "seccompProfile",
        "capabilities.drop",
        "capabilities.add",
    ):
        assert field in problems
