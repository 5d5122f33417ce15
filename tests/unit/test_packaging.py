"""Every package folder of the code ships in the wheel the images install: pyproject.toml lists it."""

from __future__ import annotations

import pytest
import tomllib
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.unit


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        "disttrain." + ".".join(path.parent.relative_to(REPO_ROOT).parts)
        for top in ("api", "common", "operator", "trainer")
        for path in (REPO_ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = sorted(folders - listed)
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
