"""The image tier: builds the Dockerfile's two targets with buildah once per run (``scripts/images/build.sh``: a
Debian base made with debootstrap, no registry, no daemon) and checks what is inside, running the images'
commands with ``buildah run``.

It costs about 7 minutes from nothing on 2 cores and half a minute once buildah's layer cache holds everything,
so ``make test`` leaves it out (its tests skip) and ``make test-images``, CI's second step, runs it with
``DISTTRAIN_TEST_IMAGES=1``. Without buildah it is a skip locally and a failure under CI (``CI=true``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT
from tests.images.buildah import available

ENABLED = os.environ.get("DISTTRAIN_TEST_IMAGES", "").lower() in ("1", "true", "yes")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TAG = os.environ.get("IMAGE_TAG", "latest")


@dataclasses.dataclass(frozen=True)
class Images:
    base: str
    operator: str
    trainer: str


@pytest.fixture(scope="session")
def images(pytestconfig: pytest.Config) -> Images:
    if not ENABLED:
        pytest.skip("image builds take minutes: `make test-images` runs them (DISTTRAIN_TEST_IMAGES=1)")
    why = available()
    if why:
        if IN_CI:
            pytest.fail(f"CI builds the images: {why}")
        pytest.skip(why)
    start = time.monotonic()
    env = {**os.environ, "PIP": f"{sys.executable} -m pip", "IMAGE_TAG": TAG}
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "images" / "build.sh")], env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        pytest.fail(f"scripts/images/build.sh exited {proc.returncode}:\n{proc.stdout}{proc.stderr[-6000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("images: ")]
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join([*lines, f"images: build.sh took {time.monotonic() - start:.0f} s"]), flush=True)
    base = next(line.split()[-1] for line in lines if line.startswith("images: base "))
    return Images(
        base=base, operator=f"localhost/disttrain-operator:{TAG}", trainer=f"localhost/disttrain-trainer:{TAG}"
    )
