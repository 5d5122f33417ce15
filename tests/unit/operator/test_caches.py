"""The operator's watch caches: versions move forward, deletions stick, sweeps drop what a watch gap hid, and only
changes that policy reads wake a job."""

from __future__ import annotations

import asyncio
import copy

import pytest

from disttrain.api import constants
from disttrain.operator import listing
from disttrain.operator.caches import ClusterCache

pytestmark = pytest.mark.timeout(30)


def pod(
    name, version, *, job="demo", role="worker", uid=None, node=None, phase="Pending", ns="default", index=0, owner=None
):
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uid or f"uid-{name}",
            "resourceVersion": str(version),
            "labels": {
                constants.LABEL_JOB_NAME: job,
                constants.LABEL_ROLE: role,
                constants.LABEL_NODE_INDEX: str(index),
            },
            "ownerReferences": [
                {
                    "apiVersion": constants.API_VERSION,
                    "kind": constants.KIND,
                    "name": job,
                    "uid": owner or f"uid-{job}",
                    "controller": True,
                }
            ],
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, "podIP": f"10.0.0.{version}"},
    }


def node(name, version, ready="True", heartbeat="t0"):
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": str(version)},
        "status": {"conditions": [{"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat}]},
    }


def job(name, version, ns="default", **status):
    return {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", "resourceVersion": str(version)},
        "spec": {},
        "status": status,
    }


def test_a_pod_event_wakes_its_job_only_when_what_policy_reads_changed():
    cache = ClusterCache()
    assert cache.put_pod(pod("demo-worker-0", 1), now=1) == ("default", "demo")
    assert cache.put_pod(pod("demo-worker-0", 1), now=2) is None, "the same version again (a re-list)"
    bound = pod("demo-worker-0", 2, node="n1", phase="Running")
    assert cache.put_pod(bound, now=3) == ("default", "demo")
    ip_only = copy.deepcopy(bound)
    ip_only["metadata"]["resourceVersion"] = "3"
    ip_only["status"]["podIP"] = "10.9.9.9"
    assert cache.put_pod(ip_only, now=4) is None, "an IP is nothing policy reads"
    assert cache.put_pod({"metadata": {"name": "unlabelled", "namespace": "default"}}, now=5) is None


def test_versions_only_move_forward_and_the_answer_to_a_write_may_come_last():
    cache = ClusterCache()
    cache.put_job(job("demo", 10, phase="Running"), now=1)  # our status write's answer
    assert cache.put_job(job("demo", 9, phase="Pending"), now=2) is None, "the watch event of an earlier write"
    assert cache.job("default", "demo")["status"]["phase"] == "Running"
    assert cache.put_job(job("demo", 11, phase="Reforming"), now=3) == ("default", "demo")


def test_a_deleted_pod_never_comes_back_and_its_successor_survives_its_late_deletion():
    cache = ClusterCache()
    old = pod("demo-worker-1", 5, node="n1", phase="Running")
    cache.put_pod(old, now=1)
    cache.remove_pod(old, now=2)
    assert cache.put_pod(old, now=3) is None, "the answer to our DELETE, after the DELETED event"
    assert cache.observe("default", "demo", "uid-demo").workers == ()
    successor = pod("demo-worker-1", 9, uid="uid-new")
    cache.put_pod(successor, now=4)
    assert cache.remove_pod(pod("demo-worker-1", 6), now=5) is None, "the predecessor's DELETED, handled late"
    assert [p.uid for p in cache.observe("default", "demo", "uid-demo").workers] == ["uid-new"]


def test_observe_gives_the_jobs_pods_and_only_the_nodes_that_host_them():
    cache = ClusterCache()
    for i, name in enumerate(["n1", "n2", "n3"]):
        cache.put_node(node(name, i + 1), now=1)
    cache.put_pod(pod("demo-worker-0", 1, node="n1", phase="Running"), now=1)
    cache.put_pod(pod("demo-agent", 2, role="agent", node="n2", phase="Running"), now=1)
    cache.put_pod(pod("other-worker-0", 3, job="other", node="n3"), now=1)
    seen = cache.observe("default", "demo", "uid-demo")
    assert [p.name for p in seen.workers] == ["demo-worker-0"] and seen.agent.name == "demo-agent"
    assert set(seen.nodes) == {"n1", "n2"}


def test_a_node_wakes_the_jobs_on_it_only_when_its_view_changed():
    cache = ClusterCache()
    cache.put_node(node("n1", 1), now=1)
    cache.put_pod(pod("demo-worker-0", 1, node="n1", phase="Running"), now=1)
    cache.put_pod(pod("other-worker-0", 2, job="other", node="n2"), now=1)
    assert cache.put_node(node("n1", 2, heartbeat="t1"), now=2) == set(), "a heartbeat"
    assert cache.put_node(node("n1", 3, ready="False"), now=3) == {("default", "demo")}
    assert cache.remove_node(node("n1", 4), now=4) == {("default", "demo")}
    assert cache.observe("default", "demo", "uid-demo").nodes == {}, "a deleted node: the core sees it missing"


def test_a_sweep_drops_what_vanished_during_a_watch_gap_and_keeps_what_came_after_its_list():
    cache = ClusterCache()
    cache.put_pod(pod("demo-worker-0", 1), now=1)
    cache.put_pod(pod("demo-worker-1", 2), now=1)  # deleted while the watch was down: no event ever comes
    cache.put_pod(pod("demo-worker-0", 1, ns="elsewhere"), now=1)
    cache.put_pod(pod("demo-worker-2", 5), now=11)  # created after the LIST began (its ADDED came first)
    touched = cache.sweep_pods("default", [pod("demo-worker-0", 1)], started=10, now=12)
    assert touched == {("default", "demo")}
    assert [p.name for p in cache.observe("default", "demo", "uid-demo").workers] == ["demo-worker-0", "demo-worker-2"]
    assert len(cache.observe("elsewhere", "demo", "uid-demo").workers) == 1, "another namespace is not swept"
    cache.put_job(job("demo", 1), now=1)
    assert cache.sweep_jobs("default", [], started=10, now=12) == {("default", "demo")}
    assert cache.job("default", "demo") is None


async def test_listings_sync_once_and_sweep_only_after_a_relist_that_no_list_covered():
    cache = ClusterCache()
    calls = []
    woken = []

    async def list_scope(scope):
        calls.append(scope)
        return [pod("demo-worker-0", 1)] if scope[0] == listing.PODS else []

    clock = iter(range(100)).__next__
    listings = listing.Listings(cache, list_scope, woken.extend, clock=lambda: float(clock()), settle_s=0.01)
    await asyncio.gather(listings.ensure_synced("default"), listings.ensure_synced("default"))
    assert sorted(calls) == [("jobs", "default"), ("nodes", ""), ("pods", "default")], "one LIST each"
    assert woken == [("default", "demo")]
    await listings.ensure_synced("default")
    assert len(calls) == 3
    listings.relisted(listing.PODS, "default")
    listings.relisted(listing.PODS, "default")  # the same burst: one sweep
    await asyncio.sleep(0.1)
    assert calls[3:] == [("pods", "default")]
    listings.relisted(listing.PODS, "unsynced")  # its first LIST is still to come: nothing now
    await asyncio.sleep(0.05)
    assert len(calls) == 4


def test_only_pods_owned_by_the_jobs_uid_are_the_jobs():
    """A job deleted and applied again under the same name: the old job's Terminating pods match the job label
    and the names, but not the new uid; they are not the new job's (counting their exit codes failed it)."""
    cache = ClusterCache()
    old = pod("demo-worker-0", 1, node="n1", phase="Failed", owner="uid-old")
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    cache.put_pod(old, now=1)
    cache.put_pod(pod("demo-agent", 2, role="agent", owner="uid-old"), now=1)
    cache.put_pod(pod("demo-worker-1", 3, index=1, owner="uid-new"), now=1)
    cache.put_pod(
        {
            **pod("demo-worker-2", 4, index=2),
            "metadata": {**pod("demo-worker-2", 4, index=2)["metadata"], "ownerReferences": []},
        },
        now=1,
    )
    new = cache.observe("default", "demo", "uid-new")
    assert [p.name for p in new.workers] == ["demo-worker-1"] and new.agent is None
    seen_old = cache.observe("default", "demo", "uid-old")
    assert [p.name for p in seen_old.workers] == ["demo-worker-0"] and seen_old.agent is not None
    assert cache.observe("default", "demo", None).workers == (), "a job without a uid owns nothing"


def test_is_owned_by_reads_every_owner_reference():
    from disttrain.operator.caches import is_owned_by, owner_uids

    body = {"metadata": {"ownerReferences": [{"uid": "a"}, {"uid": "b"}, {"name": "no-uid"}, "garbage"]}}
    assert owner_uids(body) == frozenset({"a", "b"})
    assert is_owned_by(body, "b") and not is_owned_by(body, "c") and not is_owned_by(body, None)
    assert not is_owned_by({"metadata": {}}, "a") and not is_owned_by({}, "")
