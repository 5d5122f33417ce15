"""A job admitted before the CRD refused agent ServiceAccounts in templates (or under a CRD without the rule)
fails at once: no pod ever runs with another job's agent token."""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest


@pytest.mark.parametrize("field", ["serviceAccountName", "serviceAccount"])
def test_a_template_naming_an_agent_account_fails_before_any_pod_is_created(field):
    manifest = job_manifest(replicas=2)
    manifest["spec"]["template"]["spec"][field] = "other-job-agent"
    world = World(manifest)
    actions = world.step()
    assert world.status["phase"] == "Failed"
    failed = world.condition("Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith(f"spec.template.spec.{field}: {field} other-job-agent is not allowed")
    assert actions.create_workers == () and not actions.create_agent


def test_another_account_runs():
    manifest = job_manifest(replicas=2)
    manifest["spec"]["template"]["spec"]["serviceAccountName"] = "trainer"
    world = World(manifest)
    world.step()
    assert world.status["phase"] != "Failed"
