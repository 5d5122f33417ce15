"""Names of the DistTrainJob resource and the labels/annotations every disttrain object carries."""

from typing import Final

GROUP: Final = "disttrain.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "DistTrainJob"
PLURAL: Final = "disttrainjobs"
SINGULAR: Final = "disttrainjob"
SHORT_NAME: Final = "dtj"
CATEGORIES: Final = ("all", "disttrain")
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# Labels on every object the operator creates for a job.
LABEL_JOB_NAME: Final = "disttrain.dev/job-name"
LABEL_ROLE: Final = "disttrain.dev/role"  # "worker" or "agent"
LABEL_NODE_INDEX: Final = "disttrain.dev/node-index"
ROLE_WORKER: Final = "worker"
ROLE_AGENT: Final = "agent"

# Name of the container in the user's pod template that runs the trainer (or the only container).
TRAINER_CONTAINER: Final = "trainer"

# Prefixes a user may not set in the trainer container's env: the operator owns them.
RESERVED_ENV_PREFIXES: Final = ("DISTTRAIN_", "TORCHELASTIC_")

# Job names prefix Service names (DNS-1035 labels, at most 63 characters) such as "<job>-agent" and pod
# names such as "<job>-worker-<index>-<suffix>", and are label values themselves.
MAX_JOB_NAME_LENGTH: Final = 45
DNS_1035_LABEL: Final = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""Job names: they name Services, which must be DNS-1035 labels."""

# Name of the container in the job agent pod (the only one).
AGENT_CONTAINER: Final = "agent"
# The job agent's own heartbeat (disttrain.operator.agentbeat): by default it renews its Lease this often (the
# operator's --agent-heartbeat-seconds), and the Lease is held for three renewals (for readers of the object).
AGENT_LEASE_RENEW_SECONDS: Final = 1.0
# The job agent's pulse (disttrain.operator.agentbeat): by default it pulses this often on the port named
# AGENT_PULSE_PORT_NAME (the operator's --agent-pulse-seconds; 0: no pulse), and the operator takes it for lost after
# AGENT_PULSE_SILENT_SECONDS without one, as a worker after silentAfterSeconds (1 s by default).
AGENT_PULSE_SECONDS: Final = 0.2
AGENT_PULSE_SILENT_SECONDS: Final = 1.0
AGENT_PULSE_PORT_NAME: Final = "pulse"

# torchrun's rendezvous backend in worker pods: the c10d handler that completes a round as soon as the operator's
# target node count joined and never closes the rendezvous when one node leaves. The trainer package registers it
# under this name through torch's `torchrun.handlers` entry-point group (pyproject.toml), and the handler reports
# it back to torchrun, which checks that it got the backend it asked for.
RDZV_BACKEND: Final = "disttrain"

# Local mode's state directory, shared by the local runtime and the job agent (`--state-dir`): the runtime writes
# the job to LOCAL_JOB_FILE; the agent follows it and writes the status fields it owns to LOCAL_AGENT_STATUS_FILE.
# One writer per file, so neither loses the other's updates.
LOCAL_JOB_FILE: Final = "job.json"
LOCAL_AGENT_STATUS_FILE: Final = "agent-status.json"

GPU_RESOURCE: Final = "nvidia.com/gpu"
"""The extended resource a trainer container's GPUs are requested by (one process per GPU: ``nprocPerNode``)."""

KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
"""Label of a job (copied to its worker pods) naming the Kueue LocalQueue, as Kueue's job integrations read it."""
