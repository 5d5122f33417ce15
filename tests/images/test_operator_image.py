"""The operator image: `disttrain operator` is its entrypoint and works, it renders our CRD, it has no torch."""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT
from tests.images.buildah import container, image_config
from tests.images.conftest import Images

pytestmark = pytest.mark.timeout(1800)  # the first test builds the images


def test_entrypoint_is_disttrain_operator_and_it_runs(images: Images) -> None:
    config = image_config(images.operator)
    assert config["Entrypoint"] == ["disttrain", "operator"]
    assert config["Cmd"] == ["--all-namespaces"]
    with container(images.operator) as ctr:
        usage = ctr.check("disttrain", "operator", "--help")
        assert "--all-namespaces" in usage and "--metrics-port" in usage
        ctr.check("python", "-c", "import kopf, kubernetes, disttrain.operator.handlers")
        # The same CRD as the one checked in: the image carries the models this checkout has.
        assert ctr.check("disttrain", "crd") == (REPO_ROOT / "crds" / "disttrain.dev_disttrainjobs.yaml").read_text()


def test_operator_image_has_no_torch(images: Images) -> None:
    with container(images.operator) as ctr:
        found = ctr.check("python", "-c", "import importlib.util as u; print(u.find_spec('torch') is not None)")
        assert found.strip() == "False"
        assert not list(ctr.mount().glob("opt/venv/lib/python3*/site-packages/torch*"))
