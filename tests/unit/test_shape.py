"""The shape limit ruff has no rule for: a class of the packages spans at most :data:`MAX_CLASS_LINES` lines.

Past it a class does several jobs; split one out (as :mod:`disttrain.trainer.checkpoint.groupcommit` is of the
checkpoint manager). The per-function limits (arguments, statements, complexity) are ruff's, in pyproject.toml.
``make lint`` runs this file.
"""

from __future__ import annotations

import ast

from tests.conftest import REPO_ROOT

PACKAGES = ("api", "common", "operator", "trainer")
MAX_CLASS_LINES = 400
"""Lines of a class statement, from ``class`` (its decorators not counted) to its last line, docstrings included."""


def oversized_classes(source: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every class in ``source``, nested ones included, longer than ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, node.lineno, lines))
    return found


def test_no_class_of_the_packages_exceeds_the_line_limit():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for name, line, lines in oversized_classes(path.read_text(), MAX_CLASS_LINES):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line} class {name} has {lines} lines")
    assert not offenders, f"classes over {MAX_CLASS_LINES} lines (split a part with a job of its own out):\n" + (
        "\n".join(offenders)
    )


def test_the_limit_counts_a_class_to_its_last_line_and_finds_nested_classes():
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    source = f"class Small:\n{body}\n\n\nclass Outer:\n    class Inner:\n{body.replace('    ', '        ')}\n"
    assert oversized_classes(source, 7) == []
    assert sorted(oversized_classes(source, 5)) == [("Inner", 10, 6), ("Outer", 9, 7), ("Small", 1, 6)]
