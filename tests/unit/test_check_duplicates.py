"""scripts/check_duplicates.py, the duplicated-block check of ``make lint``: what it flags and what it passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "check_duplicates.py"

BODY = """\
    total = 0
    for item in items:
        if item.weight > limit:
            continue
        total += item.weight * item.count
        seen.add(item.name)
    ratio = total / max(1, len(items))
    report.append((name, total, ratio))
    log.info("packed %s: %d", name, total)
    return total, ratio
"""
"""A 10-line function body."""


def check(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, files)], capture_output=True, text=True)


def module(path: Path, *functions: tuple[str, str]) -> Path:
    path.write_text(
        "".join(f"def {name}(items, limit, seen, report, name, log):\n{body}\n\n" for name, body in functions)
    )
    return path


def test_a_function_body_copied_into_another_module_fails_with_both_places(tmp_path):
    a = module(tmp_path / "a.py", ("pack", BODY))
    b = module(tmp_path / "b.py", ("other", "    return None\n"), ("pack_again", BODY))
    result = check(a, b)
    assert result.returncode == 1
    assert f"{a}:2-11 ~ {b}:6-15" in result.stdout, result.stdout


def test_a_copy_inside_one_file_fails_too(tmp_path):
    a = module(tmp_path / "a.py", ("pack", BODY), ("pack_again", BODY))
    result = check(a)
    assert result.returncode == 1 and f"{a}:2-11 ~ {a}:15-24" in result.stdout, result.stdout


def test_comments_docstrings_and_signatures_do_not_hide_a_copy(tmp_path):
    commented = BODY.replace("continue", "continue  # too heavy").replace("\n    ratio", "\n    # the mean\n    ratio")
    a = module(tmp_path / "a.py", ("pack", BODY))
    b = tmp_path / "b.py"
    b.write_text(f'def pack_weights(items, limit, seen, report, name, log, extra=None):\n    """Why."""\n{commented}')
    assert check(a, b).returncode == 1


def test_five_shared_lines_and_code_alike_only_in_shape_pass(tmp_path):
    five = "\n".join(BODY.strip("\n").splitlines()[:5]) + "\n    return 0\n"
    renamed = BODY.replace("total", "amount").replace("ratio", "share")
    a = module(tmp_path / "a.py", ("pack", BODY))
    b = module(tmp_path / "b.py", ("head", five), ("renamed", renamed))
    result = check(a, b)
    assert result.returncode == 0, result.stdout
