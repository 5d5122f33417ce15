"""Both images run as an unprivileged user and carry nothing of their build: no pip cache, no wheel, no mounted
build input (the torch wheel folder, the host's CA bundle), no credentials file; what they hold came from the locks
and the base handed over by digest (tests/images/test_locks.py reads the Dockerfile and the locks themselves)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.images.buildah import buildah, container, image_config
from tests.images.conftest import Images

pytestmark = pytest.mark.timeout(1800)  # the first test builds the images

TARGETS = ("operator", "trainer")
# Files that hold credentials for pip, other package managers or HTTP clients.
CREDENTIAL_FILES = {".netrc", "_netrc", ".pypirc", "pip.conf", "pip.ini", ".git-credentials", ".dockercfg"}
SKIP_DIRS = {"proc", "sys", "dev"}


def buildah_json(image: str) -> dict[str, Any]:
    """The image's OCI configuration document (rootfs.diff_ids: its layers, bottom first)."""
    document: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]
    return document


@pytest.mark.parametrize("target", TARGETS)
def test_runs_as_non_root_with_a_writable_home_and_tmp(images: Images, target: str) -> None:
    image = getattr(images, target)
    assert image_config(image)["User"] == "65532:65532"  # numeric: runAsNonRoot can verify it
    with container(image) as ctr:
        out = ctr.check("sh", "-c", 'id -u; id -g; echo "$HOME"; touch "$HOME/.probe" /tmp/.probe && echo ok')
        assert out.split() == ["65532", "65532", "/home/disttrain", "ok"]
        if target == "trainer":  # a plain run of an example writes runs/ into the working directory
            assert ctr.check("sh", "-c", "pwd; touch runs && echo ok").split() == ["/workspace", "ok"]


@pytest.mark.parametrize("target", TARGETS)
def test_no_pip_cache_wheel_credentials_or_build_mount_left(images: Images, target: str) -> None:
    with container(getattr(images, target)) as ctr, container(images.base) as base:
        root = ctr.mount()
        for leftover in ("root/.cache", "home/disttrain/.cache", "wheels", "src"):
            assert not (root / leftover).exists(), leftover
        assert os.listdir(root / "tmp") == []
        assert os.listdir(root / "mnt") == []  # where the build mounted the torch wheel
        found_credentials, wheels = [], []
        for folder, dirs, files in os.walk(root):
            if folder == str(root):
                dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            found_credentials += [os.path.join(folder, f) for f in files if f in CREDENTIAL_FILES]
            wheels += [os.path.join(folder, f) for f in files if f.endswith(".whl")]
        assert found_credentials == []
        # Debian's python3-venv brings pip's and setuptools' wheels for ensurepip; nothing else is a wheel.
        assert all(Path(w).parent == root / "usr/share/python-wheels" for w in wheels), wheels
        # The host's CA bundle was mounted over the base's during the build; the image keeps Debian's own.
        bundle = "etc/ssl/certs/ca-certificates.crt"
        assert (root / bundle).read_bytes() == (base.mount() / bundle).read_bytes()


@pytest.mark.parametrize("target", TARGETS)
def test_the_locked_installs_are_complete_and_sit_on_the_base_given_by_digest(images: Images, target: str) -> None:
    """Every package went in with --no-deps from a lock: `pip check` finds nothing missing or out of range. The
    base went in by digest (build.sh resolves even a tag to one), and the image's first layers are that base's."""
    assert re.search(r"@sha256:[0-9a-f]{64}$", images.base), images.base
    image = getattr(images, target)
    with container(image) as ctr:
        assert "No broken requirements found" in ctr.check("python", "-m", "pip", "check")
    base_layers = buildah_json(images.base)["rootfs"]["diff_ids"]
    assert buildah_json(image)["rootfs"]["diff_ids"][: len(base_layers)] == base_layers
