"""The layering of the architecture, checked statically over every source file (lazy imports included).

api <- operator, api <- trainer; operator and trainer never import each other; the api imports neither torch
nor kopf nor kubernetes; the operator never imports torch; the trainer never imports kopf.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from tests.conftest import REPO_ROOT

FORBIDDEN = {
    "api": ("disttrain.operator", "disttrain.trainer", "torch", "kopf", "kubernetes"),
    "operator": ("disttrain.trainer", "torch"),
    "trainer": ("disttrain.operator", "kopf"),
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_it_must_not(layer: str):
    offenders = []
    for path in sorted((REPO_ROOT / layer).rglob("*.py")):
        for line, module in _imports(path):
            if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN[layer]):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_operator_directory_has_no_init_so_the_stdlib_operator_module_is_never_shadowed():
    assert not (REPO_ROOT / "operator" / "__init__.py").exists()
