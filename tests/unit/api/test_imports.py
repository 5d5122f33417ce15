"""Import hygiene: the contract stays light, and the repository root never shadows the stdlib `operator`."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)


def test_importing_the_api_pulls_in_neither_torch_nor_kopf():
    run = _run(
        "import sys, disttrain.api, disttrain.api.crd, disttrain.api.validation\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kopf', 'kubernetes'))\n"
        "print(heavy)"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_stdlib_operator_still_works_from_the_repository_root():
    run = _run("import operator; print(operator.itemgetter(1)([5, 7]))")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "7"


def test_the_cli_for_crd_and_validate_does_not_need_kopf():
    run = _run("import sys, disttrain.operator.cli\nprint('kopf' in sys.modules)")
    assert run.stdout.strip() == "False", run.stderr
