"""Two operator replicas electing a leader on a Lease, on the real control plane, each a process under the chart's
RBAC with the chart's election flags.

A SIGKILLed leader looks to the API server as one whose node lost power: its renewals stop. The standby must take
over and handle a worker lost meanwhile, with nothing done twice. A paused leader (SIGSTOP: a partition or a long
pause) must stop acting once resumed, its Lease taken.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from disttrain.api.conditions import format_time
from disttrain.operator.election import EXIT_LOST
from tests.cluster.controlplane import ControlPlane
from tests.cluster.harness import eventually
from tests.cluster.operator_process import OperatorProcess
from tests.cluster.rbac import OPERATOR_NAMESPACE, install_operator_rbac
from tests.cluster.replicas import LEASE, Replicas, event_reporters, job_events, repeated_events
from tests.conftest import JobBuilder

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def replicas(controllers: ControlPlane, crd: ControlPlane, tmp_path_factory) -> Iterator[Replicas]:
    install_operator_rbac(controllers)
    controllers.kubectl("delete", "lease", "-n", OPERATOR_NAMESPACE, LEASE, "--ignore-not-found")
    pair = Replicas(controllers, tmp_path_factory.mktemp("replicas"))
    pair.start("op-a")
    eventually(lambda: pair.holder() == "op-a", what="op-a leads")
    pair.start("op-b")
    eventually(lambda: "held by op-a" in pair.by_name["op-b"].log_text(), what="op-b waits as the standby")
    yield pair
    forbidden = pair.stop()
    assert not forbidden, "a replica hit 403s under the chart's RBAC:\n" + "\n".join(forbidden[:20])


@pytest.fixture(scope="module")
def operator(replicas: Replicas) -> OperatorProcess:
    """The cluster fixture's operator: the replicas in its place."""
    return replicas.by_name["op-a"]


def test_the_standby_takes_over_a_killed_leader_and_handles_a_worker_lost_meanwhile(cluster, replicas, tmp_path):
    agent = cluster.running("fo", JobBuilder("fo"), tmp_path, replicas=2)
    before = cluster.status("fo")
    assert replicas.holder() == "op-a"
    transitions = replicas.lease().get("leaseTransitions", 0)

    replicas.by_name["op-a"].kill()  # the leader's node loses power: no renewal, no cleanup
    killed = time.monotonic()
    cluster.kubelets.finish("fo-worker-1", 137)  # and a worker is lost while nobody leads
    eventually(lambda: replicas.holder() == "op-b", timeout=30, what="the standby takes the Lease")
    took = time.monotonic() - killed
    assert replicas.lease()["leaseTransitions"] == transitions + 1

    reforming = eventually(lambda: cluster.phase("fo", "Reforming"), timeout=30, what="the new leader's reform")
    acted = time.monotonic() - killed
    assert reforming["restarts"]["byReason"] == {"PodFailed": 1}, reforming
    eventually(lambda: "fo-worker-1-1" in cluster.live_workers(), what="the lost worker replaced")
    eventually(lambda: cluster.pods()["fo-worker-1-1"]["status"].get("phase") == "Running")
    cluster.agent_reports(
        "fo", agent, worldSize=2, step=9, rendezvousRound=2, lastProgressTime=format_time(time.time())
    )
    done = eventually(lambda: cluster.phase("fo", "Running"), what="back to Running")
    time.sleep(1.5)  # the new leader had time to act on everything it saw

    # nothing done twice: one directive, one restart, one replacement, each Event once
    assert done["control"]["generation"] == before["control"]["generation"] + 1, "one directive"
    assert done["restarts"]["total"] == 1 and done["lastReform"]["to"] == 2
    workers = cluster.pods()
    assert sorted(cluster.live_workers()) == ["fo-worker-0", "fo-worker-1-1"], sorted(workers)
    assert not [name for name in workers if name.startswith("fo-worker-1-") and name != "fo-worker-1-1"]
    assert len(cluster.pods("agent")) == 1
    # The same Event may come again for a new state (Scheduled after the replacement), never twice in a row.
    events = job_events(cluster.plane, cluster.ns, "fo")
    assert not repeated_events(events), f"Events posted twice in a row: {events}"
    reporters = event_reporters(cluster.plane, cluster.ns, "fo")
    assert reporters["Created"] == {"op-a"}, reporters  # each Event names the replica that acted
    assert reporters["PodFailed"] == {"op-b"}, reporters
    print(f"leader killed -> standby holds the Lease: {took:.1f} s; -> reform directive: {acted:.1f} s")


def test_a_paused_leader_stops_acting_once_its_lease_was_taken(cluster, replicas, tmp_path):
    if replicas.by_name["op-a"].proc is None:  # the first test killed it: back as the standby
        replicas.start("op-a")
    leader_name = eventually(replicas.holder, what="a leader")
    standby_name = replicas.other(leader_name)
    leader = replicas.by_name[leader_name]
    assert leader.proc is not None
    cluster.running("fp", JobBuilder("fp"), tmp_path, replicas=1)

    os.kill(leader.proc.pid, signal.SIGSTOP)  # partitioned, or paused: it renews nothing and knows nothing of it
    try:
        eventually(lambda: replicas.holder() == standby_name, timeout=30, what="the standby takes the Lease")
    finally:
        os.kill(leader.proc.pid, signal.SIGCONT)
    # Resumed, the former leader finds its renew deadline long past and exits before it writes anything.
    assert leader.proc.wait(timeout=10) == EXIT_LOST
    assert "stops acting" in leader.log_text()
    leader.proc = None
    assert replicas.holder() == standby_name, "the former leader wrote the Lease back"
    eventually(lambda: cluster.phase("fp", "Running"), what="the job still served")
    assert sorted(cluster.live_workers()) == ["fp-worker-0"] and len(cluster.pods("agent")) == 1

    # A standby stopped (SIGTERM) exits cleanly and leaves the leader's Lease alone.
    standby = replicas.start(leader_name)
    assert standby.proc is not None
    standby.proc.terminate()
    assert standby.proc.wait(timeout=30) == 0
    standby.proc = None
    assert replicas.holder() == standby_name

    # A graceful stop (SIGTERM: a rolling update) leaves the Lease free, for a standby's next look.
    new_leader = replicas.by_name[standby_name]
    assert new_leader.proc is not None
    new_leader.proc.terminate()
    assert new_leader.proc.wait(timeout=30) == 0
    new_leader.proc = None
    assert replicas.holder() == "", "a stopped leader left the Lease held"
