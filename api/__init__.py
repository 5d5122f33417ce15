"""The DistTrainJob contract: models, plan, checkpoint manifest, CRD rendering, manifest validation.

Pure Python + pydantic. Both the operator and the trainer import this package; it must never import
torch, kopf or kubernetes (a test checks ``sys.modules``).
"""

from disttrain.api.constants import API_VERSION, GROUP, KIND, PLURAL, SHORT_NAME, VERSION
from disttrain.api.exitcodes import ExitCode
from disttrain.api.manifest import CheckpointManifest, DatasetFingerprint, FileDigest
from disttrain.api.plan import (
    InvalidWorldSizeError,
    Plan,
    lr_factor,
    plan,
    ramped_lr_scale,
    valid_node_counts,
    valid_world_sizes,
)
from disttrain.api.spec import (
    BatchPolicy,
    CheckpointSpec,
    DistTrainJob,
    DistTrainJobSpec,
    ElasticSpec,
    LRScaling,
    LRSpec,
    NodesSpec,
    RendezvousSpec,
    RestartPolicySpec,
    RunPolicySpec,
    SuccessPolicy,
    TrainingSpec,
)
from disttrain.api.status import Condition, DistTrainJobStatus, Phase

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAME",
    "VERSION",
    "ExitCode",
    "CheckpointManifest",
    "DatasetFingerprint",
    "FileDigest",
    "InvalidWorldSizeError",
    "Plan",
    "lr_factor",
    "plan",
    "ramped_lr_scale",
    "valid_node_counts",
    "valid_world_sizes",
    "BatchPolicy",
    "CheckpointSpec",
    "DistTrainJob",
    "DistTrainJobSpec",
    "ElasticSpec",
    "LRScaling",
    "LRSpec",
    "NodesSpec",
    "RendezvousSpec",
    "RestartPolicySpec",
    "RunPolicySpec",
    "SuccessPolicy",
    "TrainingSpec",
    "Condition",
    "DistTrainJobStatus",
    "Phase",
]
