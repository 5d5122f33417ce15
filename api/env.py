"""Environment variables of the worker contract: the operator (or local runtime) sets them, the trainer reads them.

Defined once here, in the manner of Kubeflow's ``envvar.go``, so the two sides never disagree on a name.
"""

from typing import Final

# JSON of :class:`disttrain.api.contract.WorkerContract`: training contract, checkpoint policy, timeouts.
CONTRACT: Final = "DISTTRAIN_CONTRACT"
JOB_NAME: Final = "DISTTRAIN_JOB_NAME"
JOB_NAMESPACE: Final = "DISTTRAIN_JOB_NAMESPACE"
JOB_UID: Final = "DISTTRAIN_JOB_UID"
# Stable identity of this node (pod name on Kubernetes, "node-3" in local mode); never a rank.
NODE_NAME: Final = "DISTTRAIN_NODE_NAME"
# The worker pod's uid (downward API ``metadata.uid``): with the node name it tells the operator which pod the job
# agent found silent in the rendezvous heartbeats, and never a later pod of the same name.
POD_UID: Final = "DISTTRAIN_POD_UID"
# The Lease the job agent renews (its own heartbeat, read by the operator), and how often; unset: it renews none.
AGENT_LEASE: Final = "DISTTRAIN_AGENT_LEASE"
AGENT_LEASE_RENEW_SECONDS: Final = "DISTTRAIN_AGENT_LEASE_RENEW_SECONDS"
# The job agent's pulse (disttrain.trainer.agent.pulse): the port it serves its pulse on, the pod IP it binds (the
# downward API's ``status.podIP``) and how often it pulses. Unset or 0: no pulse.
AGENT_PULSE_PORT: Final = "DISTTRAIN_AGENT_PULSE_PORT"
AGENT_PULSE_SECONDS: Final = "DISTTRAIN_AGENT_PULSE_SECONDS"
# The job's pulse key (a file: the job's Secret, mounted): the operator proves it before the agent pulses to it.
AGENT_PULSE_KEY_FILE: Final = "DISTTRAIN_AGENT_PULSE_KEY_FILE"
POD_IP: Final = "DISTTRAIN_POD_IP"
# Stable node index of this node (the pod's ``disttrain.dev/node-index`` label). The ``disttrain`` rendezvous
# handler orders ranks by it, and a replacement pod takes the index of the node it replaces, so every rank
# lands on the same node slot after a reform. Never a rank itself (indices may have gaps after a scale-down:
# ranks follow the order of the indices present).
NODE_INDEX: Final = "DISTTRAIN_NODE_INDEX"
# Directory holding this job's checkpoints (shared by all nodes).
CHECKPOINT_DIR: Final = "DISTTRAIN_CHECKPOINT_DIR"
# host:port of the job agent's TCPStore (the c10d rendezvous store, also the control channel).
AGENT_ENDPOINT: Final = "DISTTRAIN_AGENT_ENDPOINT"
# First Prometheus port of this node; local rank r serves on port + r. 0 disables the exporter.
METRICS_PORT: Final = "DISTTRAIN_METRICS_PORT"
# TCP port the worker's launcher listens on once the node can start its workers without waiting for imports (their
# warm interpreters are ready): the worker pod's readinessProbe. The operator brings a new node into a running group
# only once it is Ready, so the group never stops training while a newcomer imports torch. Unset or 0: none.
READY_PORT: Final = "DISTTRAIN_READY_PORT"
# The job's store secret (see disttrain.api.storeauth): a file holding it (the mounted Secret on Kubernetes), or
# the secret itself (local mode). Every client of the agent's store needs it; without it the keys cannot be found.
STORE_SECRET_FILE: Final = "DISTTRAIN_STORE_SECRET_FILE"
STORE_SECRET: Final = "DISTTRAIN_STORE_SECRET"
STORE_FRONT: Final = "DISTTRAIN_STORE_FRONT"
"""``1``: the agent serves its store behind the authenticating front; clients go through a relay of their own."""
# File the worker's launcher writes the root cause of a failure to (exit code, the traceback's last line): the
# trainer container's terminationMessagePath on Kubernetes, a file of the node's own in local mode.
TERMINATION_LOG: Final = "DISTTRAIN_TERMINATION_LOG"
# Warm worker interpreters (disttrain.trainer.launch.warmstart): "0" turns them off (every worker starts a cold
# Python); "spawn" keeps one per local worker that becomes the worker, instead of one per node that forks them.
WARM_WORKERS: Final = "DISTTRAIN_WARM_WORKERS"
WARM_SPAWN: Final = "spawn"
# The launcher's debug folder (spec.debug; disttrain.trainer.launch.debugenv): NCCL's debug files and the per-rank
# logs of this start of the pod. Unset without debug mode.
DEBUG_DIR: Final = "DISTTRAIN_DEBUG_DIR"
# The worker's launcher listens here (a Unix socket; "@name" is Linux's abstract namespace) for workers that wait for
# the next rendezvous round in place instead of exiting (disttrain.trainer.launch.handover). Unset: every reform
# restarts
# the worker processes.
LAUNCHER_SOCKET: Final = "DISTTRAIN_LAUNCHER_SOCKET"
# The rendezvous round a worker process belongs to: the worker's launcher sets it before it starts (or hands a round to)
# its workers. A directive issued for an earlier round is not acted on (disttrain.api.control.judge_directive).
RENDEZVOUS_ROUND: Final = "DISTTRAIN_RENDEZVOUS_ROUND"
# Local mode (disttrain.operator.local): the node a process belongs to, inherited by every process of the node's tree
# and read from /proc/<pid>/environ to find and kill the whole tree (torchrun starts workers in sessions of their own).
LOCAL_MARKER: Final = "DISTTRAIN_LOCAL_MARKER"
# Local mode: "1" (the default) starts local pods as forks of a fork server that imported torch once
# (disttrain.operator.local.forkserver); "0" starts every pod as a cold process.
LOCAL_FORK: Final = "DISTTRAIN_LOCAL_FORK"
# Local mode: bytes the fork server's placeholder for LOCAL_MARKER holds, the longest marker a forked pod can carry.
LOCAL_MARKER_ROOM: Final = 128
