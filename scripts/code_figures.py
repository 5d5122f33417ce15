"""Size figures of the code, measured from the tree: README lines, the largest module and class, the longest function,
the longest parameter list, and the test times of the last `make test` (build/test-logs/times.json, written by
scripts/test_tiers.py) with its most expensive tests.

    python scripts/code_figures.py               # the figures, test times from the last run
    python scripts/code_figures.py --time-unit   # also time `make test-unit` now
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "common", "operator", "trainer")
"""The shipped code (src/disttrain/ links to these folders)."""
TOP_TESTS = 10
"""How many of the most CPU-expensive tests of the last tier run to name."""


def python_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def span(node: ast.AST) -> int:
    return int(getattr(node, "end_lineno", 0)) - int(getattr(node, "lineno", 0)) + 1


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    count = len([a for a in names if a.arg not in ("self", "cls")])
    return count + (args.vararg is not None) + (args.kwarg is not None)


def figures() -> dict[str, str]:
    modules: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    lengths: list[tuple[int, str]] = []
    for path in python_files():
        text = path.read_text()
        name = str(path.relative_to(REPO))
        modules.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((span(node), f"{name}:{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((parameter_count(node), f"{name}:{node.name}"))
                lengths.append((span(node), f"{name}:{node.name}"))
    readme = len((REPO / "README.md").read_text().splitlines())
    kinds = (("module", modules), ("class", classes), ("function", lengths), ("params", functions))
    top = {label: max(items) for label, items in kinds}
    return {
        "README lines": str(readme),
        "largest module (lines)": f"{top['module'][0]}  {top['module'][1]}",
        "largest class (lines)": f"{top['class'][0]}  {top['class'][1]}",
        "longest function (lines)": f"{top['function'][0]}  {top['function'][1]}",
        "most parameters of a function": f"{top['params'][0]}  {top['params'][1]}",
    }


def test_times(time_unit: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    if time_unit:
        start = time.monotonic()
        code = subprocess.call(["make", "test-unit"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        out["make test-unit (now)"] = f"{time.monotonic() - start:.0f} s (exit {code})"
    times = REPO / "build" / "test-logs" / "times.json"
    if times.exists():
        recorded = json.loads(times.read_text())
        tiers = ", ".join(f"{tier} {seconds:.0f} s" for tier, seconds in recorded["tiers"].items())
        out["last tier run (wall)"] = f"{recorded['wall_s']:.0f} s ({recorded['wall_s'] / 60:.1f} min): {tiers}"
    else:
        out["last tier run"] = "none recorded (run `make test`)"
    rows = [
        json.loads(line)
        for costs in sorted((REPO / "build" / "test-logs").glob("*.costs.jsonl"))
        for line in costs.read_text().splitlines()
        if line.strip()
    ]
    if rows:
        total = sum(row["cpu_s"] for row in rows)
        out["CPU of the last tier run"] = f"{total:.0f} s in {len(rows)} tests (>= {total / 2 / 60:.1f} min on 2 cores)"
        for rank, row in enumerate(sorted(rows, key=lambda r: -r["cpu_s"])[:TOP_TESTS], 1):
            out[f"costliest test {rank}"] = f"{row['cpu_s']:.0f} s CPU, {row['wall_s']:.0f} s wall  {row['test']}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-unit", action="store_true", help="time `make test-unit` now")
    args = parser.parse_args()
    rows = {**figures(), **test_times(args.time_unit)}
    width = max(map(len, rows))
    for label, value in rows.items():
        print(f"{label:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
