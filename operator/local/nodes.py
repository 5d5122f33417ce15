"""Local "pods": a process tree per worker node (torchrun + its workers) and one for the job agent.

A :class:`LocalPod` turns its process into the :class:`~disttrain.operator.observed.PodView` that reconcile
reads, exactly as the kube adapter turns a Pod object into one: Running while the root process lives,
Succeeded / Failed with the exit code once it exited, Terminating while a deletion is in progress. Each pod
runs on its own local "machine" (a :class:`NodeView`); killing the machine SIGKILLs the whole tree and marks
the node NotReady, which reconcile treats as a lost node: at once by default, or after a delay, as Kubernetes'
node controller does after ``node-monitor-grace-period`` (until then the dead pod still looks Running and
Ready, and only the rendezvous heartbeats tell that it is gone).
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from typing import IO, Optional

from disttrain.operator.local import proctree
from disttrain.operator.observed import NodeView, PodPhase, PodView

# Seconds a deleted pod gets between SIGTERM and SIGKILL (terminationGracePeriodSeconds, shortened locally).
GRACE_SECONDS = 10.0


@dataclasses.dataclass
class LocalPod:
    name: str
    uid: str
    index: int
    """Node index (-1 for the agent)."""
    node: str
    """The local machine it runs on."""
    marker: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    created_at: float
    metrics_port: int = 0
    deleting_since: Optional[float] = None
    node_lost: bool = False
    """The machine died (its processes are killed); see :attr:`is_marked_lost` for when anyone is told."""
    cordoned: bool = False
    """The machine was cordoned (chaos drain-node): its node reads unschedulable, as ``kubectl drain`` leaves it."""
    not_ready_at: float = 0.0
    """Wall time from which a lost machine's node reads NotReady (kill time + the runtime's NotReady delay)."""
    exit_code: Optional[int] = None
    ready_port: int = 0
    """Running only once the tree connected to this port (the store); 0: Running as soon as it started."""
    started: bool = False
    readiness_port: int = 0
    """The pod's readinessProbe: Ready once its launcher listens here (its workers start warm); 0: no probe."""
    probed_ready: bool = False
    ready_at: Optional[float] = None
    """When the readiness probe first passed."""
    termination_log: str = ""
    """The file the worker's launcher writes its failure to (terminationMessagePath on Kubernetes)."""

    def poll(self) -> Optional[int]:
        if self.exit_code is None:
            code = self.proc.poll()
            if code is not None:
                self.exit_code = 128 - code if code < 0 else code  # -9 -> 137, as a container reports it
        return self.exit_code

    @property
    def is_alive(self) -> bool:
        return self.poll() is None

    def is_started(self) -> bool:
        """The container is up: for a worker, its torchrun reached the store (see proctree.is_connected_to)."""
        if not self.started:
            self.started = not self.ready_port or proctree.is_connected_to(self.marker, self.proc.pid, self.ready_port)
        return self.started

    def passes_readiness_probe(self) -> bool:
        """The readinessProbe (a TCP connect, as the kubelet's ``tcpSocket`` check); once passed, it stays passed
        (the launcher keeps the port open for its life)."""
        if not self.probed_ready:
            if not self.readiness_port:
                self.probed_ready = True
            else:
                try:
                    socket.create_connection(("127.0.0.1", self.readiness_port), timeout=0.2).close()
                    self.probed_ready = True
                except OSError:
                    pass
        if self.probed_ready and self.ready_at is None:
            self.ready_at = time.time()
        return self.probed_ready

    def is_training(self) -> bool:
        """Its worker serves its metrics (``DISTTRAIN_METRICS_PORT``): a member of the group. A hot spare waiting in
        the rendezvous has started no worker, so nothing listens there."""
        if not self.metrics_port:
            return False
        try:
            socket.create_connection(("127.0.0.1", self.metrics_port), timeout=0.5).close()
            return True
        except OSError:
            return False

    @property
    def is_marked_lost(self) -> bool:
        """The machine died and its NotReady delay has passed: the node reads NotReady, the pod unready."""
        return self.node_lost and time.time() >= self.not_ready_at

    def view(self) -> PodView:
        phase: PodPhase
        code = self.poll()
        if code is None and not self.node_lost and not self.is_started():
            phase, ready = "Pending", False
        elif self.node_lost:
            phase, ready = "Running", not self.is_marked_lost
        elif code is None:
            phase, ready = "Running", self.passes_readiness_probe()
        else:
            phase, ready = ("Succeeded" if code == 0 else "Failed"), False
        return PodView(
            name=self.name,
            uid=self.uid,
            node_index=self.index,
            phase=phase,
            ready=ready,
            node_name=self.node,
            created_at=self.created_at,
            ready_at=self.ready_at if ready else None,
            deleting_since=self.deleting_since,
            exit_code=None if phase == "Running" else code,
            termination_message=self._termination_message() if phase == "Failed" else "",
        )

    def _termination_message(self) -> str:
        """What the launcher wrote on failure, as the kubelet reads terminationMessagePath (capped at 4096 bytes)."""
        if not self.termination_log:
            return ""
        try:
            with open(self.termination_log, "rb") as source:
                return source.read(4096).decode("utf-8", "replace")
        except OSError:
            return ""

    def node_view(self) -> NodeView:
        return NodeView(name=self.node, ready=not self.is_marked_lost, unschedulable=self.cordoned)

    def kill_machine(self, not_ready_after: float = 0.0) -> None:
        """The machine dies: every process of the pod gets SIGKILL; the node turns NotReady ``not_ready_after``
        seconds later (a dead kubelet stops renewing its Lease; the node controller notices after its grace)."""
        self.node_lost = True
        self.not_ready_at = time.time() + not_ready_after
        proctree.kill_tree(self.marker, self.proc.pid)
        self.poll()

    def terminate(self, now: float) -> None:
        """A graceful delete: SIGTERM to the container's main process (torchrun stops its workers)."""
        if self.deleting_since is None:
            self.deleting_since = now
            if self.is_alive:
                try:
                    self.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def is_gone(self, now: float) -> bool:
        """Finish a deletion: True once no process of the pod is left (SIGKILL after the grace period)."""
        if self.deleting_since is None:
            return False
        if self.is_alive and now - self.deleting_since < GRACE_SECONDS:
            return False
        tree = proctree.find_tree(self.marker, self.proc.pid if self.is_alive else None)
        if tree and (now - self.deleting_since >= GRACE_SECONDS or not self.is_alive):
            proctree.kill_tree(self.marker, self.proc.pid)
        self.poll()
        return not self.is_alive

    def force_delete(self) -> None:
        proctree.kill_tree(self.marker, self.proc.pid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.poll()

    def close(self) -> None:
        try:
            self.log.close()
        except OSError:
            pass


def chaos_victim(pods: Iterable[LocalPod], index: Optional[int] = None) -> Optional[LocalPod]:
    """The node a chaos kill-node or drain-node hits (the one of ``index`` if given): a running member of the group
    rather than an idle hot spare, not index 0 (rank 0) when another will do, the newest first; None when none runs."""
    alive = [p for p in pods if p.is_alive and not p.node_lost and p.deleting_since is None and not p.cordoned]
    if index is not None:
        alive = [p for p in alive if p.index == index]
    return max(alive, key=lambda p: (p.is_training(), p.index != 0, p.created_at), default=None)
