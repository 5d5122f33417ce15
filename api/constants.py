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
