"""`disttrain convert`'s output is what the real API server accepts (CRD schema, CEL rules, the HPA)."""

from __future__ import annotations

import pytest
import yaml

from disttrain.operator import convert
from tests.unit.operator.test_convert import CONTRACT, MANIFESTS

pytestmark = pytest.mark.usefixtures("crd")


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.stem for p in MANIFESTS])
def test_converted_objects_pass_the_real_api_server(control_plane, namespace, path):
    objects = convert.convert(yaml.safe_load(path.read_text()), CONTRACT).objects
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
    applied = control_plane.kubectl(
        "apply", "--dry-run=server", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects)
    )
    assert applied.stdout.count("serverside-applied (server dry run)") == len(objects), applied.stdout
