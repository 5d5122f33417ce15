"""The trainer image: torch, the `disttrain` torchrun rendezvous handler, the job agent and the examples; the tinylm
example trains under torchrun from the pods the operator builds, with the agent in a second container."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.api import constants
from tests.conftest import REPO_ROOT
from tests.images.buildah import container, image_config
from tests.images.conftest import Images
from tests.images.pods import run_job, short_job

pytestmark = pytest.mark.timeout(1800)  # the first test builds the images

# One interpreter start (torch takes seconds to import here): what the trainer image must carry.
PROBE = f"""
import importlib.metadata as m, importlib.util as u, json
import torch, kubernetes, disttrain.trainer.agent
handlers = m.entry_points(group="torchrun.handlers")
# What torchrun does with them (torch/distributed/elastic/rendezvous/registry.py): load, call, register the result.
assert callable(handlers["{constants.RDZV_BACKEND}"].load()())
print(json.dumps({{"handlers": {{e.name: e.value for e in handlers}}, "torch": torch.__version__,
                  "kopf": u.find_spec("kopf") is not None}}))
"""


def test_trainer_image_carries_torch_the_handler_and_the_examples(images: Images) -> None:
    assert image_config(images.trainer)["WorkingDir"] == "/workspace"
    with container(images.trainer) as ctr:
        found = json.loads(ctr.check("python", "-c", PROBE))
        assert found["handlers"] == {constants.RDZV_BACKEND: "disttrain.trainer.launch.rendezvous:handler_creator"}
        assert found["torch"].startswith("2.")
        assert not found["kopf"], "kopf is the operator's, not the trainer's"
        root = ctr.mount()
        for example in ("examples/tinylm/train.py", "examples/tinylm/corpus.txt", "examples/jobs/tinylm.yaml"):
            assert (root / "workspace" / example).read_bytes() == (REPO_ROOT / example).read_bytes()


def test_tinylm_trains_under_torchrun_with_the_disttrain_handler(images: Images, tmp_path: Path) -> None:
    job = short_job(REPO_ROOT / "examples" / "jobs" / "tinylm.yaml", max_steps=3)
    run = run_job(images.trainer, job, tmp_path)
    assert run.returncode == 0, f"{run.log[-4000:]}\n--- agent ---\n{run.agent_log[-2000:]}"
    assert f"--rdzv-backend={constants.RDZV_BACKEND}" in run.command
    assert "examples/tinylm/train.py" in run.command
    assert "tinylm:" in run.log and "parameters" in run.log  # the script's own first line: it ran
    manifest = json.loads((run.checkpoints / "default" / "tinylm" / "step-3" / "COMPLETE.json").read_text())
    assert manifest["step"] == 3
    # The job agent, from the same image, relayed the progress and the checkpoint (what the job's status shows).
    assert run.agent_status["step"] == 3
    assert run.agent_status["lastCheckpoint"]["step"] == 3
    assert run.agent_status["worldSize"] == 1
