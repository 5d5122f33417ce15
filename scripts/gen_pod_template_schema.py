"""Regenerate api/schemas/pod-template-v<K8S>.json: the structural OpenAPI v3 schema of a PodTemplateSpec.

Run by developers when moving to a newer Kubernetes version (needs the dev extra's kubernetes-validate):
    python scripts/gen_pod_template_schema.py 1.33

The CRD embeds the result under spec.template so that the API server validates and explains the template
(a preserved, schemaless template keeps typos, and the API server does not ratchet rules over a subtree holding
preserved data: after a rule is tightened, an existing object refuses even the removal of its finalizer). Converting
Kubernetes' JSON schema into a *structural* one means: inline every $ref, one type per node, int-or-string
instead of oneOf, and no descriptions or list-map annotations (their keys would have to be required or
defaulted in a CRD). Lists therefore merge atomically, which is what a pod template needs.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import kubernetes_validate

ROOT = "io.k8s.api.core.v1.PodTemplateSpec"
INT_OR_STRING = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
KEPT_KEYS = {"properties", "items", "additionalProperties", "required", "type", "minimum", "maximum"}


def _definitions(version: str) -> dict[str, Any]:
    package = pathlib.Path(kubernetes_validate.__file__).parent
    path = package / "kubernetes-json-schema" / f"v{version}.0-local" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]


def _convert(node: dict[str, Any], defs: dict[str, Any], stack: tuple[str, ...]) -> dict[str, Any]:
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in stack:  # no recursion in PodSpec today; stay structural if one appears
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return _convert(defs[name], defs, (*stack, name))
    if "oneOf" in node:  # IntOrString and Quantity
        return dict(INT_OR_STRING)
    out: dict[str, Any] = {}
    kind = node.get("type")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind:
        out["type"] = kind
    for key in KEPT_KEYS - {"type"}:
        if key not in node:
            continue
        value = node[key]
        if key == "properties":
            out[key] = {k: _convert(v, defs, stack) for k, v in sorted(value.items())}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, defs, stack)
        elif key == "required":
            out[key] = sorted(value)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def build(version: str) -> dict[str, Any]:
    defs = _definitions(version)
    schema = _convert(defs[ROOT], defs, (ROOT,))
    # Only labels and annotations of the template's metadata mean anything for a worker pod.
    meta = schema["properties"]["metadata"]["properties"]
    schema["properties"]["metadata"]["properties"] = {k: meta[k] for k in ("labels", "annotations")}
    return schema


def main() -> None:
    version = sys.argv[1] if len(sys.argv) > 1 else "1.33"
    out = pathlib.Path(__file__).resolve().parent.parent / "api" / "schemas" / f"pod-template-v{version}.json"
    out.write_text(json.dumps(build(version), sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
