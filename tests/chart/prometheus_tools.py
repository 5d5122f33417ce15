"""Debian's ``prometheus`` package: ``promtool`` (lint and unit-test rules, parse PromQL) and the ``prometheus``
server itself (the e2e test scrapes a local job with it). ``make .venv/.installed`` installs the package; without
it a developer's run skips, CI's (``CI=true``) fails, as for helm."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def find_binary(name: str) -> str:
    """``name`` on $PATH or in /usr/bin; a missing one skips the test, except under CI where it is a failure."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file() else None)
    if found:
        return found
    message = f"{name} not found: install the Debian package 'prometheus' (`make .venv/.installed` does)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``promtool ARGS``; output captured as text."""
    return subprocess.run([find_binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)
