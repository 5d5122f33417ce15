"""The layering of the architecture, checked statically over every source file (lazy imports included).

api, common <- operator, trainer; operator and trainer never import each other; api and common import neither
each other nor torch, kopf or kubernetes; the operator never imports torch; the trainer never imports kopf. Inside
the trainer, store <- checkpoint, agent, launch <- the training loop (:data:`TRAINER_PACKAGES`).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from tests.conftest import REPO_ROOT

FORBIDDEN = {
    "api": ("disttrain.common", "disttrain.operator", "disttrain.trainer", "torch", "kopf", "kubernetes"),
    "common": ("disttrain.api", "disttrain.operator", "disttrain.trainer", "torch", "kopf", "kubernetes"),
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


TRAINER_PACKAGES = {
    "store": ("store",),
    "checkpoint": ("checkpoint", "metrics"),
    "agent": ("agent", "store", "checkpoint"),
    "launch": ("launch", "store", "agent.heartbeats"),
}
"""What each of the trainer's programs may import of the trainer (the package docstrings say why); the training
loop (the modules at the top of trainer/) may import all of them."""


TRAINER = "disttrain.trainer"


def _trainer_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """What ``path`` imports of the trainer, as dotted paths below ``disttrain.trainer``: ``from disttrain.trainer.a
    import b`` counts as ``a.b`` (a module or a name in it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("disttrain.trainer.")]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(TRAINER):
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, module.removeprefix("disttrain.trainer.")) for line, module in found]


@pytest.mark.parametrize("package", sorted(TRAINER_PACKAGES))
def test_each_trainer_program_imports_only_what_its_package_allows(package: str):
    allowed = TRAINER_PACKAGES[package]
    offenders = []
    for path in sorted((REPO_ROOT / "trainer" / package).rglob("*.py")):
        for line, module in _trainer_imports(path):
            if not any(module == ok or module.startswith(ok + ".") for ok in allowed):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line} imports disttrain.trainer.{module}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("package", sorted(TRAINER_PACKAGES))
def test_each_trainer_package_says_what_it_is_and_what_it_may_import(package: str):
    doc = ast.get_docstring(ast.parse((REPO_ROOT / "trainer" / package / "__init__.py").read_text()))
    assert doc and "May import" in doc, f"trainer/{package}/__init__.py: a docstring with a 'May import' line"
