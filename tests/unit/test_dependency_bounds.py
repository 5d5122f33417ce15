"""pyproject.toml's runtime dependency bounds are true: upper bounds everywhere, torch's lower bound no older
than the newest torch API the trainer imports."""

from __future__ import annotations

import re

import tomllib
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from tests.conftest import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
RUNTIME = [
    *PYPROJECT["project"]["dependencies"],
    *PYPROJECT["project"]["optional-dependencies"]["operator"],
    *PYPROJECT["project"]["optional-dependencies"]["trainer"],
    *PYPROJECT["project"]["optional-dependencies"]["agent"],
]

# The torch version that first shipped each API the trainer imports that is newer than 2.4, by the name the
# trainer imports it with. DefaultStager, StagingOptions and AsyncSaveResponse: torch 2.9 (pytorch/tutorials#3711
# documents DefaultStager as "versionadded 2.9"; use_non_blocking_copy is the name since pytorch/pytorch#158337).
FIRST_TORCH = {
    "DefaultStager": "2.9",
    "StagingOptions": "2.9",
    "AsyncSaveResponse": "2.9",
    "fully_shard": "2.6",
    "FSDPModule": "2.6",
    "get_total_norm": "2.6",
    "clip_grads_with_norm_": "2.6",
}


def _lower(requirement: Requirement) -> Version:
    [bound] = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return bound


def test_every_runtime_dependency_has_an_upper_bound():
    unbounded = [r for r in RUNTIME if not any(s.operator in ("<", "<=", "==", "~=") for s in Requirement(r).specifier)]
    assert unbounded == []


def test_torchs_lower_bound_is_the_oldest_torch_with_the_apis_the_trainer_imports():
    source = "\n".join(p.read_text() for p in (REPO_ROOT / "trainer").rglob("*.py"))
    unused = [name for name in FIRST_TORCH if not re.search(rf"\b{name}\b", source)]
    assert unused == [], "the table names APIs the trainer no longer uses: update it and the bound"
    [torch_req] = [Requirement(r) for r in RUNTIME if Requirement(r).name == "torch"]
    assert _lower(torch_req) == max(Version(v) for v in FIRST_TORCH.values())
    assert Version(torch.__version__.split("+")[0]) in torch_req.specifier  # the tested torch is admitted
