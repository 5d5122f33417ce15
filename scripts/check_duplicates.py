"""Fail when two places in the tracked Python files share a run of 6 (MIN_LINES) identical normalised lines.

`make lint` runs it over every tracked *.py file: the packages, tests, bench, examples and scripts. A line is
normalised as pylint's symilar does it (its `stripped_lines`): white space and comments dropped, and docstrings,
import statements, function signatures and lines without a word character (a lone bracket) left out. Two places
that share 6 such lines in a row, in two files or in one, are a duplicated block: make one piece of code serve both
(a helper, a fixture, a parametrized test). Code alike only in shape (other names, other values) is not flagged.

Not pylint's own checker: its `Similar` compares files pairwise and never a file with itself, and parsing the tree
with astroid takes it about 25 s here. This script tokenizes each file once (`tokenize`, `ast`) and indexes every
window of 6 lines, about 3 s for the whole tree. Declared boilerplate, copies meant to stand on their own, is the
short list ALLOWED below, each entry with its reason.

Usage: python scripts/check_duplicates.py [--min-lines N] [paths...] (default: every tracked *.py file). Prints
``a.py:10-24 ~ b.py:40-54`` for each duplicated block (first and last line of each side) and exits 1 if any.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

MIN_LINES = 6
"""A run of this many identical normalised lines is a duplicated block."""
WORD = re.compile(r"\w")

# Declared boilerplate: pairs of file patterns (fnmatch) whose shared runs are meant to be there, each with why.
ALLOWED: list[tuple[str, str, str]] = [
    (
        "examples/*/train.py",
        "examples/*/train.py",
        "each example is one file a user copies on its own, so the training loop is written out in each",
    ),
]


@dataclass(frozen=True)
class Place:
    path: str
    first: int  # 1-based, inclusive
    last: int


def tracked_python_files(root: Path) -> list[Path]:
    """Every tracked *.py file that is a file of its own (src/disttrain/ holds symlinks to the packages)."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=root, check=True, capture_output=True, text=True).stdout
    return [root / name for name in out.split() if not (root / name).is_symlink() and (root / name).is_file()]


def ignored_lines(tree: ast.Module) -> set[int]:
    """Line numbers of docstrings, import statements and function signatures (up to the body's first line)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.update(range(node.lineno, node.body[0].lineno))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and is_docstring(node):
            first = node.body[0]
            out.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return out


def is_docstring(node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = node.body[0] if node.body else None
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def code_lines(path: Path) -> list[tuple[str, int]]:
    """The normalised lines of a file that carry code, each with its 1-based line number.

    A line is its tokens joined by one space (comments dropped), keyed by the line its first token starts on; lines
    of docstrings, imports and signatures and lines without a word character (a lone bracket) are left out.
    """
    source = path.read_text(encoding="utf-8")
    skip = ignored_lines(ast.parse(source, filename=str(path)))
    rows: dict[int, list[str]] = defaultdict(list)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type != tokenize.ENDMARKER:
            rows[tok.start[0]].append(tok.string)
    lines = ((" ".join(tokens), number) for number, tokens in sorted(rows.items()) if number not in skip)
    return [(text, number) for text, number in lines if WORD.search(text)]


def allowed(a: str, b: str) -> bool:
    return any((fnmatch(a, x) and fnmatch(b, y)) or (fnmatch(a, y) and fnmatch(b, x)) for x, y, _ in ALLOWED)


def find_duplicates(files: dict[str, list[tuple[str, int]]], min_lines: int) -> list[tuple[Place, Place]]:
    """Maximal runs of at least min_lines identical lines shared by two places, each pair once."""
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in files.items():
        texts = [t for t, _ in lines]
        for i in range(len(texts) - min_lines + 1):
            windows[tuple(texts[i : i + min_lines])].append((name, i))
    # Each matching pair of window starts, then grown into maximal runs: a start whose predecessors also match
    # belongs to the run that begins earlier.
    matches: set[tuple[str, int, str, int]] = set()
    for places in windows.values():
        for j, (na, ia) in enumerate(places):
            for nb, ib in places[j + 1 :]:
                if na == nb and abs(ia - ib) < min_lines:
                    continue  # a run overlapping itself: a repeated line, not a copied block
                matches.add((na, ia, nb, ib))
    pairs: list[tuple[Place, Place]] = []
    for na, ia, nb, ib in sorted(matches):
        if (na, ia - 1, nb, ib - 1) in matches:
            continue
        n = min_lines
        while (na, ia + n - min_lines + 1, nb, ib + n - min_lines + 1) in matches:
            n += 1
        la, lb = files[na], files[nb]
        pairs.append((Place(na, la[ia][1], la[ia + n - 1][1]), Place(nb, lb[ib][1], lb[ib + n - 1][1])))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-lines", type=int, default=MIN_LINES)
    parser.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    paths = [p.resolve() for p in args.paths] or tracked_python_files(root)
    files = {}
    for p in paths:
        name = str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
        files[name] = code_lines(p)
    found = [(a, b) for a, b in find_duplicates(files, args.min_lines) if not allowed(a.path, b.path)]
    for a, b in found:
        print(f"{a.path}:{a.first}-{a.last} ~ {b.path}:{b.first}-{b.last}")
    if found:
        print(
            f"{len(found)} duplicated blocks of {args.min_lines}+ identical lines: make one piece of code serve"
            " both, or declare boilerplate in scripts/check_duplicates.py ALLOWED",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
