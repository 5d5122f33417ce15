"""A user's image FROM the trainer image (examples/custom-image): it builds on ours, and its own job runs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.images.buildah import buildah, container, image_config
from tests.images.conftest import TAG, Images
from tests.images.pods import run_job, short_job

pytestmark = pytest.mark.timeout(1800)  # the first test builds the images

EXAMPLE = REPO_ROOT / "examples" / "custom-image"


@pytest.fixture(scope="module")
def custom_image(images: Images) -> Iterator[str]:
    name = f"localhost/disttrain-test-custom-image:{TAG}"
    proc = subprocess.run(
        [
            "buildah",
            "bud",
            "--quiet",
            "--isolation",
            "chroot",
            "--pull=never",
            "--build-arg",
            f"TRAINER_IMAGE={images.trainer}",
            "-t",
            name,
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    yield name
    buildah("rmi", name)


def test_the_custom_image_runs_its_own_job(custom_image: str, tmp_path: Path) -> None:
    job = short_job(EXAMPLE / "job.yaml", max_steps=4)
    run = run_job(custom_image, job, tmp_path)
    assert run.returncode == 0, f"{run.log[-4000:]}\n--- agent ---\n{run.agent_log[-2000:]}"
    assert "regression/train.py" in run.command
    assert (run.checkpoints / "default" / "regression" / "step-4" / "COMPLETE.json").is_file()
    assert run.agent_status["lastCheckpoint"]["step"] == 4


def test_the_custom_image_keeps_our_user_and_owns_nothing_it_should_not(custom_image: str) -> None:
    assert image_config(custom_image)["User"] == "65532:65532"
    with container(custom_image) as ctr:
        root = ctr.mount()
        code = root / "workspace" / "regression" / "train.py"
        assert code.read_bytes() == (EXAMPLE / "train.py").read_bytes()
        assert code.stat().st_uid == 0  # read-only to the user the job runs as
        assert not (root / "tmp" / "requirements.txt").exists()
