"""How the adapter reads the API server's answers: the job loop wakes itself when the answer to its own status
write carries someone else's change, and a transient 403 is retried, not remembered as a refusal.

The race it closes (seen as pods never recreated after a resume, about 1 run in 8 of the kmock suspend test):
the user's ``suspend: false`` lands between our read and our status patch; the patch's answer (newer) goes into
the cache, the watch event of the user's edit (older) is then dropped, and nothing wakes the job.
"""

from __future__ import annotations

import copy

from disttrain.operator.handlers import changed_by_others
from disttrain.operator.patches import apply_merge_patch, merge_patch

READ = {
    "apiVersion": "disttrain.dev/v1alpha1",
    "kind": "DistTrainJob",
    "metadata": {"name": "demo", "namespace": "default", "resourceVersion": "30", "generation": 2},
    "spec": {"runPolicy": {"suspend": True}, "nodes": {"replicas": 2}},
    "status": {"phase": "Suspended", "replicas": 2, "lastCheckpoint": {"step": 30}},
}
PATCH = {"replicas": 0, "lastCheckpoint": None}


def answer_to(patch, before=READ, version="33"):
    """What the API server answers: ``before`` with our status patch applied, at a new resourceVersion."""
    answered = apply_merge_patch(copy.deepcopy(before), {"status": patch})
    answered["metadata"]["resourceVersion"] = version
    answered["metadata"]["managedFields"] = [{"manager": "disttrain", "operation": "Update"}]
    return answered


def test_our_own_write_alone_is_not_news():
    assert not changed_by_others(READ, PATCH, answer_to(PATCH))


def test_a_spec_edit_between_read_and_write_is_news():
    resumed = apply_merge_patch(READ, {"spec": {"runPolicy": {"suspend": False}}, "metadata": {"generation": 3}})
    assert changed_by_others(READ, PATCH, answer_to(PATCH, before=resumed))


def test_an_agent_report_between_read_and_write_is_news():
    reported = apply_merge_patch(READ, {"status": {"rendezvousRound": 4}})
    assert changed_by_others(READ, PATCH, answer_to(PATCH, before=reported))


def test_a_scale_between_read_and_write_is_news():
    scaled = apply_merge_patch(READ, {"spec": {"nodes": {"replicas": 3}}})
    assert changed_by_others(READ, PATCH, answer_to(PATCH, before=scaled))


def test_apply_merge_patch_inverts_merge_patch():
    old = {"a": {"b": 1, "c": [1, 2]}, "d": "x"}
    new = {"a": {"b": 2}, "f": {"g": True}}
    assert apply_merge_patch(old, merge_patch(old, new)) == new
    assert apply_merge_patch({"a": {"b": 1}}, {"a": {"b": None, "c": 3}}) == {"a": {"c": 3}}
    assert apply_merge_patch({"a": 1}, {"a": {"x": 1}}) == {"a": {"x": 1}}
    assert old == {"a": {"b": 1, "c": [1, 2]}, "d": "x"}, "the target is not changed in place"


def _api_error(status: int, message: str):
    import json

    from kubernetes import client as k8s

    error = k8s.ApiException(status=status, reason="Forbidden")
    error.body = json.dumps({"kind": "Status", "message": message})
    return error


def test_a_pod_security_refusal_is_remembered_but_a_missing_service_account_is_retried_at_once():
    from disttrain.operator.handlers import is_refusal

    assert is_refusal(_api_error(403, 'pods "w-0" is forbidden: violates PodSecurity "restricted:latest"'))
    assert is_refusal(_api_error(403, 'pods "w-0" is forbidden: exceeded quota: compute'))
    assert not is_refusal(
        _api_error(
            403,
            'pods "w-0" is forbidden: error looking up service account default/default: '
            'serviceaccount "default" not found',
        )
    )
    assert not is_refusal(_api_error(409, "already exists")) and not is_refusal(_api_error(429, "slow down"))
